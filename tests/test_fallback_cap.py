"""The fallback's daily spend caps (colocate:fallbackCap): per cell and per key, counted from
the fallback's answered usage at colocate:fallbackPrice, through the real Worker in workerd.
Past a cap the fallback is not called: 429 naming the cap, Retry-After to the day's end;
pods go on serving (docs/worker.md, "Routing")."""

from __future__ import annotations

import json
import math
import time

import pytest

from colocate.cell import settings
from colocate.errors import ConfigError
from colocate.pods import standin
from colocate.probe import live
from tests.support.images import GUARDED_IMAGE
from tests.support.workerd import OPERATOR_TOKENS, auth, cell_plan, request, running_cell

PRICE = 100_000.0  # $ per 1M tokens, in and out: $0.10 a token, so a few requests reach a cap
MESSAGES = [{"role": "user", "content": "hello there"}]
MAX_TOKENS = 4
# One fallback answer's cost: the stand-in fallback reports these tokens (colocate.pods.standin).
COST = (standin.prompt_tokens({"messages": MESSAGES}) + MAX_TOKENS) * PRICE / 1e6
BODY = json.dumps({"model": "m", "messages": MESSAGES, "max_tokens": MAX_TOKENS}).encode()
# What the router reserves for one before calling the fallback (spendcap.js worstCost): every
# body byte a prompt token, and max_tokens. A request goes only if that fits beside the spend.
WORST = (len(BODY) + MAX_TOKENS) * PRICE / 1e6
KEY_CAP, CELL_CAP = round(WORST + 1.5 * COST, 2), round(WORST + 3.5 * COST, 2)
# The keys here have no cap of their own (the stack's keys.defaults gives one): the cell's per-key cap holds.
NO_OWN_CAP = {"defaults": {"fallbackUsdPerDay": 0}}
DAY_S = 86_400


@pytest.fixture(scope="module")
def cell():
    with running_cell({"stateTtlMs": 60_000}, split_tokens=True, fallbackPrice={"input": PRICE, "output": PRICE},
                      fallbackCap={"cellUsdPerDay": CELL_CAP, "keyUsdPerDay": KEY_CAP}, keys=NO_OWN_CAP) as c:
        yield c


def chat(cell, key):
    return request(cell.url, "POST", "/v1/chat/completions", body=BODY,
                   headers={"authorization": f"Bearer {key['key']}", "content-type": "application/json"})


def seconds_to_day_end() -> int:
    return math.ceil(DAY_S - time.time() % DAY_S)


def refused_by(res, who: str, cap: float, field: str, before: int, after: int, used: float = 2 * COST) -> None:
    assert res.status == 429 and res.headers["x-colocate-backend"] == "none"
    assert res.json()["error"] == {
        "message": f"no pod could serve this request, and the fallback API's spend cap for today leaves no room for it: "
                   f"${cap:.2f} a day for {who} (colocate:fallbackCap.{field}), ${used:.2f} spent or reserved, this request up "
                   f"to ${WORST:.2f}; retry when a pod is back, or after 00:00 UTC",
        "type": "insufficient_quota", "code": "fallback_spend_cap"}
    assert after - 1 <= int(res.headers["retry-after"]) <= before + 1


def usage(cell, key) -> dict:
    read = auth(OPERATOR_TOKENS["readToken"])
    rows = request(cell.url, "GET", f"/_colocate/usage?key={key['id']}", headers=read).json()["usage"]
    return {k: sum(r[k] for r in rows) for k in ("requests", "pod_requests", "fallback_requests", "fallback_microusd")}


@pytest.mark.slow
def test_the_fallback_stops_at_each_keys_cap_then_at_the_cells_and_pods_still_serve(cell):
    a, b, c = (cell.create_key(n) for n in ("cap-a", "cap-b", "cap-c"))
    fallback_calls = cell.fallback.requests
    cell.pod.set_fault("error")
    try:
        # Key a: two answers bought (the second starts under its cap), the third refused.
        assert [chat(cell, a).headers["x-colocate-backend"] for _ in range(2)] == ["fallback", "fallback"]
        before = seconds_to_day_end()
        res = chat(cell, a)
        refused_by(res, "this key", KEY_CAP, "keyUsdPerDay", before, seconds_to_day_end())
        # Key b: two answers bring the cell to 4 answers, past its cap; key c, new, is refused by the cell's.
        assert [chat(cell, b).status for _ in range(2)] == [200, 200]
        before = seconds_to_day_end()
        refused_by(chat(cell, c), "this cell", CELL_CAP, "cellUsdPerDay", before, seconds_to_day_end(), 4 * COST)
        assert cell.fallback.requests == fallback_calls + 4  # a refusal never reaches the fallback
        # The live view shows the day's spend against the caps.
        deadline = time.monotonic() + 15
        while True:  # the isolate's counts reach the object within its flush (a second here)
            doc = request(cell.url, "GET", "/_colocate/live", headers=auth(OPERATOR_TOKENS["readToken"])).json()
            spent = doc["fallback_spend"]
            if spent["usd"] >= 4 * COST - 1e-6 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert (spent["usd"], spent["cell_cap_usd"], spent["key_cap_usd"]) == (pytest.approx(4 * COST), CELL_CAP, KEY_CAP)
        assert (f"fallback spend {spent['day']} (UTC): ${4 * COST:,.2f} of ${CELL_CAP:,.2f} a day for the cell; "
                f"each key ${KEY_CAP:,.2f} a day") in live.table(live.build(doc, None))
    finally:
        cell.pod.set_fault("ok")
    # The caps are the fallback's: the pod serves every key (its breaker, opened by the
    # errors above, forced closed for these three).
    admin = auth(OPERATOR_TOKENS["adminToken"])
    assert request(cell.url, "PUT", "/_colocate/breaker", body={"force": "closed"}, headers=admin).status == 200
    try:
        assert [chat(cell, k).headers["x-colocate-backend"] for k in (a, b, c)] == ["pod-0"] * 3
    finally:
        request(cell.url, "PUT", "/_colocate/breaker", body={"force": None}, headers=admin)
    # A request is counted when admitted, its backend once its answer ends: both reach the object in
    # the isolate's flushes, so wait for each key's pod answer (a loaded machine flushed b's late once).
    deadline = time.monotonic() + 15
    while any(usage(cell, k)["pod_requests"] < 1 for k in (a, b, c)) and time.monotonic() < deadline:
        time.sleep(0.1)
    each = round(COST * 1e6)
    assert usage(cell, a) == {"requests": 4, "pod_requests": 1, "fallback_requests": 2, "fallback_microusd": 2 * each}
    assert usage(cell, b) == {"requests": 3, "pod_requests": 1, "fallback_requests": 2, "fallback_microusd": 2 * each}
    assert usage(cell, c) == {"requests": 2, "pod_requests": 1, "fallback_requests": 0, "fallback_microusd": 0}


@pytest.mark.slow
def test_the_days_spend_moves_with_the_generation(tmp_path):
    """Spent in us-east.g1, then a migration to g2: the key's spend and the cell's (rebuilt from
    the imported daily rows) hold the caps there."""
    g1 = [{"name": "us-east.g1", "region": "us-east", "status": "active"}]
    moved = [{"name": "us-east.g1", "region": "us-east", "status": "draining"},
             {"name": "us-east.g2", "region": "us-east", "status": "active"}]
    key_cap, cell_cap = round(WORST + 1.5 * COST, 2), round(WORST + 1.9 * COST, 2)  # two answers pass both
    raw = {"fallbackPrice": {"input": PRICE, "output": PRICE},
           "fallbackCap": {"cellUsdPerDay": cell_cap, "keyUsdPerDay": key_cap}, "keys": NO_OWN_CAP}
    with running_cell({"stateTtlMs": 300}, generations=g1, storage_dir=tmp_path / "do", split_tokens=True, **raw) as cell:
        a, b = cell.create_key("moved-a"), cell.create_key("moved-b")
        cell.pod.set_fault("error")
        assert [chat(cell, a).headers["x-colocate-backend"] for _ in range(2)] == ["fallback", "fallback"]
        deadline = time.monotonic() + 15
        while usage(cell, a)["fallback_microusd"] < 2 * round(COST * 1e6) and time.monotonic() < deadline:
            time.sleep(0.1)  # flushed to g1 before it stops
        cell.restart(cell_plan({"stateTtlMs": 300}, generations=moved, split_tokens=True, **raw))
        before = seconds_to_day_end()
        refused_by(chat(cell, a), "this key", key_cap, "keyUsdPerDay", before, seconds_to_day_end())
        before = seconds_to_day_end()
        refused_by(chat(cell, b), "this cell", cell_cap, "cellUsdPerDay", before, seconds_to_day_end())
        assert usage(cell, a)["fallback_microusd"] == 2 * round(COST * 1e6)


@pytest.mark.slow
def test_a_key_may_hold_a_cap_of_its_own(monkeypatch, capsys):
    """keys.py create --fallback-usd-per-day: the key's own cap, in place of the cell's per-key one."""
    from scripts import keys

    raw = {"fallbackPrice": {"input": PRICE, "output": PRICE},
           "fallbackCap": {"cellUsdPerDay": 0, "keyUsdPerDay": round(WORST + 10 * COST, 2)}, "keys": NO_OWN_CAP}
    own = round(WORST + 0.5 * COST, 2)
    with running_cell({"stateTtlMs": 60_000}, split_tokens=True, **raw) as cell:
        monkeypatch.setenv("COLOCATE_ADMIN_TOKEN", OPERATOR_TOKENS["adminToken"])
        assert keys.main(["create", "--url", cell.url, "--name", "own-cap", "--fallback-usd-per-day", str(own), "--json"]) == 0
        made = json.loads(capsys.readouterr().out)
        assert made["fallback_microusd_day"] == round(own * 1e6)
        assert keys.main(["create", "--url", cell.url, "--name", "bad", "--fallback-usd-per-day", "-1"]) == 2
        assert "--fallback-usd-per-day -1.0: must be a number of $ >= 0" in capsys.readouterr().err
        cell.pod.set_fault("error")
        assert chat(cell, made).headers["x-colocate-backend"] == "fallback"  # under its cap when it starts
        before = seconds_to_day_end()
        res = chat(cell, made)
        assert res.status == 429 and res.json()["error"]["message"] == (
            f"no pod could serve this request, and the fallback API's spend cap for today leaves no room for it: ${own:.2f} "
            f"a day for this key (the key's fallback_microusd_day), ${COST:.2f} spent or reserved, this request up to "
            f"${WORST:.2f}; retry when a pod is back, or after 00:00 UTC")
        assert seconds_to_day_end() - 1 <= int(res.headers["retry-after"]) <= before + 1
        other = cell.create_key("cell-cap")  # no cap of its own: the cell's per-key one, not reached
        assert [chat(cell, other).headers["x-colocate-backend"] for _ in range(2)] == ["fallback", "fallback"]


def test_a_cap_needs_the_fallbacks_price_and_names_each_bad_field():
    price = (0.15, 0.6)
    assert settings.parse_fallback_cap(None, None) == (0.0, 0.0)
    assert settings.parse_fallback_cap({"cellUsdPerDay": 50, "keyUsdPerDay": "2.5"}, price) == (50.0, 2.5)
    with pytest.raises(ConfigError, match=r"colocate:fallbackCap.keyUsdPerDay.*colocate:fallbackPrice, which is not set"):
        settings.parse_fallback_cap({"keyUsdPerDay": 2}, None)
    with pytest.raises(ConfigError, match=r"colocate:fallbackCap.cellUsdPerDay.*at least 0"):
        settings.parse_fallback_cap({"cellUsdPerDay": -1}, price)
    with pytest.raises(ConfigError, match=r"colocate:fallbackCap.dailyUsd.*unknown key.*cellUsdPerDay, keyUsdPerDay"):
        settings.parse_fallback_cap({"dailyUsd": 5}, price)
    with pytest.raises(ConfigError, match=r"colocate:fallbackCap.*must be a mapping"):
        settings.parse_fallback_cap(5, price)


def cell_raw(**extra) -> dict:
    raw = {"region": "us-east", "generations": [{"name": "us-east.g1", "region": "us-east", "status": "active"}],
           "accountId": "0" * 32, "pod": {"provider": "runpod", "hop": "token", "image": GUARDED_IMAGE},
           "worker": {"subdomain": "acme"},
           "fallbackModel": "gpt-4o-mini", "fallbackPrice": {"input": 2.5, "output": 10}}
    return {**raw, **extra}


SECRETS = frozenset(settings.ALWAYS_SECRET) | {"runpodApiKey"}


@pytest.mark.parametrize("cap", [None, {}, {"keyUsdPerDay": 5}])
def test_a_cell_without_a_daily_cap_is_refused_naming_the_key_a_value_and_zero_as_the_knowing_choice(cap):
    raw = cell_raw(**({} if cap is None else {"fallbackCap": cap}))
    with pytest.raises(ConfigError) as err:
        settings.parse(raw, "t", secrets=SECRETS)
    assert err.value.key == "colocate:fallbackCap.cellUsdPerDay" and err.value.exit_code == 2
    assert "pulumi config set --path colocate:fallbackCap.cellUsdPerDay 20" in err.value.fix
    assert "colocate:fallbackCap.cellUsdPerDay 0 to run with no cap, knowingly" in err.value.fix
    # Planning a move spends nothing, so it does not ask (pulumi preview does).
    assert settings.parse(raw, "t", secrets=SECRETS, require_cap=False).fallback_cap[0] == 0.0


def test_zero_is_no_cap_chosen_knowingly_and_leaves_the_key_defaults_as_they_are():
    s = settings.parse(cell_raw(fallbackCap={"cellUsdPerDay": 0}), "t", secrets=SECRETS)
    assert s.fallback_cap == (0.0, 0.0) and s.key_defaults["monthly_tokens"] == 1_000_000_000


def test_a_keys_default_month_costs_no_more_than_the_cap_allows():
    # $5 a day for 31 days at the dearer price ($10 per 1M out) is 15.5M tokens.
    s = settings.parse(cell_raw(fallbackCap={"cellUsdPerDay": 5}), "t", secrets=SECRETS)
    assert s.key_defaults["monthly_tokens"] == 15_500_000
    assert settings.monthly_tokens_within_cap(s.fallback_cap, s.fallback_price) == 15_500_000
    from colocate.cell import plan

    assert plan.plan_cell(s).worker.binding("DEFAULT_MONTHLY_TOKENS").text == "15500000"  # what the Worker gives a key
    # The per-key cap, when tighter, is what one key is held to; a generous cap keeps the default.
    tight = settings.parse(cell_raw(fallbackCap={"cellUsdPerDay": 5, "keyUsdPerDay": 1}), "t", secrets=SECRETS)
    assert tight.key_defaults["monthly_tokens"] == 3_100_000
    loose = settings.parse(cell_raw(fallbackCap={"cellUsdPerDay": 10_000}), "t", secrets=SECRETS)
    assert loose.key_defaults["monthly_tokens"] == settings.KEY_LIMIT_DEFAULTS["monthlyTokens"]
    # An explicit default within the cap stands; above it (or unlimited) it is refused with the bound.
    at = cell_raw(fallbackCap={"cellUsdPerDay": 5}, keys={"defaults": {"monthlyTokens": 15_500_000}})
    assert settings.parse(at, "t", secrets=SECRETS).key_defaults["monthly_tokens"] == 15_500_000
    for too_many in (15_500_001, 0):
        over = cell_raw(fallbackCap={"cellUsdPerDay": 5}, keys={"defaults": {"monthlyTokens": too_many}})
        with pytest.raises(ConfigError) as err:
            settings.parse(over, "t", secrets=SECRETS)
        assert err.value.key == "colocate:keys.defaults.monthlyTokens" and err.value.value == too_many
        assert "colocate:fallbackCap.cellUsdPerDay ($5 a day)" in err.value.problem
        assert "pulumi config set --path colocate:keys.defaults.monthlyTokens 15500000" in err.value.fix


def test_preview_refuses_a_stack_without_a_cap_before_declaring_anything():
    import pulumi

    from tests.support.pulumi_mocks import RecordingMocks, run_program, stack_config

    config, keys = stack_config("apac-jp", drop=("fallbackCap",))
    mocks = RecordingMocks()
    with pytest.raises(pulumi.RunError) as err:
        run_program("apac-jp", config, keys, mocks=mocks)
    assert str(err.value).startswith("colocate:fallbackCap.cellUsdPerDay: the fallback API's daily spend needs a cap")
    assert not mocks.resources  # no pod rented, no Worker uploaded


@pytest.mark.parametrize("stack", ["apac-jp", "apac-tw", "eu-west", "us-east", "sandbox"])
def test_every_shipped_cell_names_a_finite_cap_and_its_price(stack):
    from colocate import stackfile

    raw, _ = stackfile.read_config(stack)
    assert raw["fallbackCap"]["cellUsdPerDay"] > 0 and set(raw["fallbackPrice"]) == {"input", "output"}


def test_cost_shows_todays_fallback_spend_against_the_caps():
    from colocate.scaling import cost

    rows = [{"day": "2026-12-05", "key_id": k, "requests": 2, "prompt_tokens": 20, "completion_tokens": 8, "pod_requests": 0,
             "fallback_requests": 2, "estimated_tokens": 0, "fallback_microusd": spent} for k, spent in
            (("key_a", 3_000_000), ("key_b", 1_250_000))]
    rows.append({**rows[0], "day": "2026-12-04", "fallback_microusd": 9_000_000})  # yesterday: not today's spend
    r = cost.report(rows, cost_per_hr=0.5, hours=24, window_days=2, price=cost.Price(0.15, 0.6), today="2026-12-05",
                    caps=(5.0, 3.0))
    doc = cost.to_json(r)
    assert (doc["fallback_spend_today"], doc["fallback_top_key_spend_today"]) == (4.25, 3.0)
    assert (doc["fallback_cap_cell_per_day"], doc["fallback_cap_key_per_day"]) == (5.0, 3.0)
    assert "fallback today (UTC)          $4.25 of $5.00 a day (cell); highest key $3.00 of $3.00 a day" in cost.table(r)
    uncapped = cost.report([{k: v for k, v in rows[0].items() if k != "fallback_microusd"}], cost_per_hr=0.5, hours=24,
                           window_days=1, price=None, today="2026-12-05")
    assert "fallback today (UTC)          n/a of no cap (cell); highest key n/a of no cap" in cost.table(uncapped)


def test_the_live_views_spend_is_checked():
    assert live.spend_of({}) is None
    assert live.spend_line(live.spend_of({"fallback_spend": {"day": "2026-12-05", "usd": None, "cell_cap_usd": None,
                                                             "key_cap_usd": None}})) == (
        "fallback spend 2026-12-05 (UTC): not counted (set colocate:fallbackPrice)")
    with pytest.raises(live.LiveDataError, match="fallback_spend is .*each amount a number >= 0 or null"):
        live.spend_of({"fallback_spend": {"day": "2026-12-05", "usd": -1}})
