"""The cell's cost against the fallback API: colocate/scaling/cost.py (pure) and scripts/cost.py against a real router."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from colocate.cell import capacity, settings
from colocate.errors import ConfigError
from colocate.scaling import cost
from scripts import cost as cli
from tests.support.workerd import SECRETS, chat, running_cell

ROOT = cli.ROOT


def row(day, key, prompt, completion, pod, fb):
    return {"day": day, "key_id": key, "requests": pod + fb, "prompt_tokens": prompt, "completion_tokens": completion,
            "pod_requests": pod, "fallback_requests": fb}


PRICE = cost.Price(0.15, 0.60)


def test_costs_and_break_even_from_usage_rows():
    rows = [row("2026-12-01", "a", 6_000_000, 2_000_000, 1000, 0), row("2026-12-01", "b", 1_000_000, 1_000_000, 0, 100),
            row("2026-12-02", "a", 3_000_000, 1_000_000, 400, 0)]
    r = cost.report(rows, cost_per_hr=0.5, hours=48, window_days=2, price=PRICE)
    assert r.pods.requests == 1400 and r.fallback.requests == 100
    assert r.pods.tokens == 12_000_000 and r.fallback.tokens == 2_000_000
    assert r.pods_cost == pytest.approx(24.0)
    assert r.pods_cost_per_m == pytest.approx(2.0)
    assert r.pods_tokens_at_fallback_price == pytest.approx(9 * 0.15 + 3 * 0.60)
    assert r.fallback_spend == pytest.approx(0.15 + 0.60)
    # the mix: 10M in, 4M out -> $ per 1M blended; the cell's $12/day buys 12 / blended million tokens
    blended = (10 * 0.15 + 4 * 0.60) / 14
    assert r.blended_price_per_m == pytest.approx(blended)
    assert r.break_even_tokens_per_day == pytest.approx(12 / blended * 1e6)
    assert r.tokens_per_day == pytest.approx(7_000_000)
    assert r.cheaper == "api" and "pays off from" in r.verdict()
    assert r.monthly_cell_cost == pytest.approx(0.5 * 730)
    assert r.monthly_api_cost_at_volume == pytest.approx(7 * blended * 730 / 24)
    doc = cost.to_json(r)
    assert doc["break_even_tokens_per_day"] == round(12 / blended * 1e6) and doc["cheaper"] == "api"


def test_a_busy_cell_is_cheaper_and_utilisation_needs_a_capacity():
    rows = [row("2026-12-01", "a", 400_000_000, 100_000_000, 1_000_000, 0)]
    r = cost.report(rows, cost_per_hr=0.5, hours=24, window_days=1, price=PRICE, pod_count=2, capacity_rpm=1000)
    assert r.cheaper == "cell" and "cheaper than the API" in r.verdict()
    assert r.utilisation == pytest.approx(1_000_000 / (1000 * 60 * 24 * 2))
    assert cost.report(rows, cost_per_hr=0.5, hours=24, window_days=1, price=PRICE).utilisation is None
    assert "pass --capacity-rpm" in cost.table(cost.report(rows, cost_per_hr=0.5, hours=24, window_days=1, price=PRICE))


def test_mixed_days_split_tokens_by_requests_and_say_so():
    r = cost.report([row("2026-12-01", "a", 300, 100, 3, 1)], cost_per_hr=1, hours=1, window_days=1, price=PRICE)
    assert r.pods.prompt_tokens == pytest.approx(225) and r.fallback.completion_tokens == pytest.approx(25)
    assert any("split between pods and fallback by requests" in n for n in r.notes)


def test_the_fallbacks_spend_is_what_the_worker_counted_and_today_is_part_of_the_window():
    """A key-day where the pods wrote long answers and the fallback short ones (the sandbox's fallback
    answers in a few tokens): split by requests, two thirds of the pods' tokens were priced as the
    fallback's, a spend over twice what the Worker counted against the cap for the same day."""
    pod_answers, fb_answers = 10 * 600, 20 * 9  # 10 pod requests of 600 tokens, 20 fallback ones of 9
    prompts = 30 * 100
    spent = math.ceil(20 * (100 * 0.15 + 9 * 0.60))  # microusd, as the Worker counts each answer (rounded up)
    today = {**row("2026-12-07", "a", prompts, pod_answers + fb_answers, 10, 20), "fallback_microusd": spent}
    r = cost.report([today], cost_per_hr=0.8, hours=1, window_days=1, price=PRICE, today="2026-12-07")
    assert r.fallback_spend == pytest.approx(spent / 1e6) == r.today_fallback_spend
    # the two lines add up: the pods' tokens at the fallback's price and the fallback's own spend are all the tokens
    assert r.pods_tokens_at_fallback_price + r.fallback_spend == pytest.approx(PRICE.of(prompts, pod_answers + fb_answers))
    assert r.fallback.requests == 20 and r.fallback.tokens < 0.2 * (prompts + pod_answers + fb_answers)
    earlier = {**row("2026-12-06", "a", 1000, 1000, 0, 5), "fallback_microusd": 750}
    both = cost.report([earlier, today], cost_per_hr=0.8, hours=48, window_days=2, price=PRICE, today="2026-12-07")
    assert both.fallback_spend == pytest.approx((spent + 750) / 1e6) and both.fallback_spend > both.today_fallback_spend
    # at a price other than the one the Worker counted at (--price), the spend is that price's
    other = cost.report([today], cost_per_hr=0.8, hours=1, window_days=1, price=cost.Price(1, 1), price_counted=False)
    assert other.fallback_spend == pytest.approx(other.fallback.tokens / 1e6)


def test_utilisation_counts_the_tokens_a_pod_fills_with_and_a_fallback_share_it_cannot_explain_is_said():
    """A pod kept busy with 5,000-token prompts (bench.busy's shape) is full at a fourteenth of the
    knee's requests: counted in requests it looked 7 % busy while the fallback took two thirds."""
    rpm, size = capacity.pod_capacity(), capacity.knee_request_tokens()
    assert 350 <= size <= 360  # 256 in, about 100 out
    minutes = 6
    per_min = rpm * size / 5001  # as many 5,000-token prompts a minute as the knee's tokens
    pod_requests = round(per_min * minutes)
    rows = [{**row("2026-12-07", "a", pod_requests * 5000 + 2 * pod_requests * 30, pod_requests + 2 * pod_requests * 8,
                   pod_requests, 2 * pod_requests), "fallback_microusd": 2 * pod_requests * math.ceil(30 * 0.15 + 8 * 0.6)}]
    full = cost.report(rows, cost_per_hr=0.8, hours=minutes / 60, window_days=1, price=PRICE, capacity_rpm=rpm,
                       capacity_tokens_per_request=size)
    assert 0.9 <= full.utilisation <= 1.1, full.utilisation
    assert not any("not for want of capacity" in n for n in full.notes)
    assert f"of {rpm * size:,.0f} tokens/min ({rpm:g} req/min of {size:,.0f} tokens) x 1 pods" in cost.table(full)
    idle = cost.report(rows, cost_per_hr=0.8, hours=10, window_days=1, price=PRICE, capacity_rpm=rpm,
                       capacity_tokens_per_request=size)
    assert idle.utilisation < 0.1
    assert any(n.startswith("the fallback served 67% of the requests while the pods were 1% busy over 10 h")
               for n in idle.notes), idle.notes


def test_amounts_under_a_cent_are_written_as_they_are():
    assert [cost.dollars(v) for v in (0, 0.001, 0.0012345, 0.000004, 0.02, 1234.5)] == [
        "$0.00", "$0.001", "$0.0012", "$0.000004", "$0.02", "$1,234.50"]
    r = cost.report([{**row("2026-12-07", "a", 100, 10, 0, 1), "fallback_microusd": 21}], cost_per_hr=0.8, hours=1,
                    window_days=1, price=PRICE, today="2026-12-07", caps=(0.001, 0.0005))
    text = cost.table(r)
    assert "$0.000021 of $0.001 a day (cell); highest key $0.000021 of $0.0005 a day" in text, text
    from colocate.probe import live

    line = live.spend_line({"day": "2026-12-07", "usd": 0.0004, "cell_cap_usd": 0.001, "key_cap_usd": None})
    assert line == "fallback spend 2026-12-07 (UTC): $0.0004 of $0.001 a day for the cell; each key no cap"


def test_the_pods_cost_and_what_they_saved_or_cost_more_are_told_apart():
    """11 s of a sandbox: the pods cost $0.0025, their tokens $0.00011 at the fallback's price. The
    line said "(the cell cost $0.0023)" below "pods $0.0025": two costs of the cell in one report."""
    r = cost.report([row("2026-12-07", "a", 111, 150, 3, 0)], cost_per_hr=0.8, hours=11 / 3600, window_days=1,
                    price=PRICE)
    text = cost.table(r)
    assert "pods              $0.0024 = $0.8/hr x 11 s" in text, text
    assert "(the cell cost $0.0023 more)" in text, text
    cheap = cost.report([row("2026-12-07", "a", 10**9, 10**9, 3, 0)], cost_per_hr=0.8, hours=1, window_days=1,
                        price=PRICE)
    assert "(the cell saved $749.20)" in cost.table(cheap)


def test_without_a_price_only_the_pods_cost():
    r = cost.report([row("2026-12-01", "a", 300, 100, 3, 0)], cost_per_hr=1, hours=2, window_days=1, price=None)
    assert r.break_even_tokens_per_day is None and r.cheaper is None
    assert "set colocate:fallbackPrice" in r.verdict()
    with pytest.raises(cost.UsageError, match="prompt_tokens is -1"):
        cost.report([row("d", "a", -1, 0, 1, 0)], cost_per_hr=1, hours=1, window_days=1, price=None)


def test_the_setting_is_validated():
    assert settings.parse_fallback_price(None) is None
    assert settings.parse_fallback_price({"input": 0.15, "output": "0.6"}) == (0.15, 0.6)
    with pytest.raises(ConfigError, match="fallbackPrice"):
        settings.parse_fallback_price({"input": 0.15})
    with pytest.raises(ConfigError, match="fallbackPrice.output"):
        settings.parse_fallback_price({"input": 0.15, "output": -1})


def test_durations_read_as_durations():
    assert [cost.duration(h) for h in (52 / 3600, 192 / 3600, 0.5, 2 + 5 / 60, 30, 24 * 30)] == [
        "52 s", "3 min 12 s", "30 min", "2 h 5 min", "30 h", "30 days"]


def test_a_window_shorter_than_the_minimum_is_not_scaled_to_a_day():
    rows = [row("2026-12-05", "a", 300, 100, 6, 0)]
    short = cost.report(rows, cost_per_hr=0.8, hours=52 / 3600, window_days=52 / 86_400, price=PRICE)
    assert short.tokens_per_day is None and short.cheaper is None and short.monthly_api_cost_at_volume is None
    assert short.break_even_tokens_per_day == pytest.approx(0.8 * 24 / PRICE.blended(300, 100) * 1e6)
    text = cost.table(short)
    assert "cell cost over 52 s" in text and "x 52 s" in text
    assert "52 s of traffic is too short to scale to a day (at least 1 h)" in text
    assert "which is cheaper now is not known" in short.verdict()
    assert cost.to_json(short)["tokens_per_day"] is None and cost.to_json(short)["cheaper"] is None
    hour = cost.report(rows, cost_per_hr=0.8, hours=cost.MIN_SCALE_HOURS, window_days=cost.MIN_SCALE_HOURS / 24, price=PRICE)
    assert hour.tokens_per_day == pytest.approx(400 * 24) and hour.cheaper == "api"


def test_plot_draws_a_png(tmp_path):
    r = cost.report([row("2026-12-01", "a", 6_000_000, 2_000_000, 1000, 0)], cost_per_hr=0.5, hours=24,
                    window_days=1, price=PRICE)
    out = tmp_path / "cost.png"
    cost.plot(r, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def cell():
    with running_cell({"stateTtlMs": 200}, compute_ms=1) as c:
        for _ in range(6):
            assert c.call("POST", "/v1/chat/completions", body=chat()).status == 200
        yield c


def _run(capsys, *argv):
    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.slow
def test_cli_reads_the_routers_usage(cell, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("COLOCATE_READ_TOKEN", SECRETS["PROBE_TOKEN"])
    import time

    deadline = time.monotonic() + 15
    while True:  # the isolate's usage reaches the object within a second of each request
        code, out, err = _run(capsys, "--url", cell.url, "--cost-per-hr", "0.5", "--price", "0.15,0.6", "--since", "1d",
                              "--json", "--plot", str(tmp_path / "c.png"))
        assert code == 0, err
        doc = json.loads(out)
        if doc["pods"]["requests"] >= 6 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert doc["pods"]["requests"] == 6 and doc["pods"]["tokens"] > 0
    assert doc["pods_cost"] == pytest.approx(12.0) and doc["fallback_price_per_m"] == {"input": 0.15, "output": 0.6}
    assert doc["break_even_tokens_per_day"] == pytest.approx(12 / doc["blended_price_per_m"] * 1e6, rel=1e-3)
    assert (tmp_path / "c.png").exists()
    # a pod's capacity is the default profile's knee unless given (colocate/cell/capacity.py), and said so
    assert doc["capacity_rpm"] == capacity.pod_capacity() and doc["utilisation"] is not None
    assert any("rtx4090-qwen2.5-7b-int4" in n for n in doc["notes"])
    code, out, _ = _run(capsys, "--url", cell.url, "--cost-per-hr", "0.5", "--since", "1d")
    assert code == 0 and "served by pods" in out and "set colocate:fallbackPrice" in out


def test_cli_usage_errors_exit_2(capsys, monkeypatch):
    monkeypatch.delenv("COLOCATE_READ_TOKEN", raising=False)
    monkeypatch.delenv("COLOCATE_PROBE_TOKEN", raising=False)
    code, _, err = _run(capsys, "--since", "30x", "--url", "http://127.0.0.1:9")
    assert code == 2 and "--since '30x'" in err
    code, _, err = _run(capsys)
    assert code == 2 and "no target" in err
    code, _, err = _run(capsys, "--url", "http://127.0.0.1:9", "--price", "abc")
    assert code == 2 and "--price 'abc'" in err
    code, _, err = _run(capsys, "--url", "http://127.0.0.1:9", "--hours", "-1")
    assert code == 2 and "--hours -1" in err
    code, _, err = _run(capsys, "--url", "http://127.0.0.1:9")
    assert code == 2 and "COLOCATE_READ_TOKEN" in err


def test_cli_as_a_subprocess_prints_help():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "cost.py"), "--help"], capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.returncode == 0 and "--since" in out.stdout and "--plot" in out.stdout


@pytest.mark.slow
@pytest.mark.parametrize("figure", [0.35, None])
def test_endpoints_the_team_runs_cost_their_declared_figure_and_say_whose_it_is(cell, capsys, monkeypatch, tmp_path,
                                                                                 figure):
    from colocate import stackfile

    monkeypatch.setenv("COLOCATE_READ_TOKEN", SECRETS["PROBE_TOKEN"])
    stacks = tmp_path / "stacks"
    stacks.mkdir()
    stackfile.path_of("apac-tw-own", stacks).write_bytes(stackfile.path_of("apac-tw-own").read_bytes())
    endpoint = {"ip": "203.0.113.7", "port": 8443, "location": "TPE", **({"costPerHr": figure} if figure else {})}
    stackfile.write_config("apac-tw-own", {"pod": {"provider": "existing", "endpoints": [endpoint]}}, stacks)
    code, out, err = _run(capsys, "--url", cell.url, "--stack", "apac-tw-own", "--stacks-dir", str(stacks), "--since",
                          "1d", "--hours", "10", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["cost_per_hr"] == (figure or 0) and doc["pods_cost"] == pytest.approx(10 * (figure or 0))
    assert doc["cost_source"] == "colocate:pod.endpoints[].costPerHr"
    note = next(n for n in doc["notes"] if "endpoints you run" in n)
    assert ("look free here" in note) == (figure is None)
