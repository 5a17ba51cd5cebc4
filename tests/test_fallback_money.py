"""The fallback's money (worker/src/spendcap.js): passthrough only for the models the operator
names, each at its price; each fallback request's worst case reserved when the router decides
to call the fallback, so requests at once never pass a cap; a default per-key cap in every
shipped stack (docs/worker.md, "Routing", step 7)."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from colocate import stackfile
from colocate.cell import settings
from colocate.errors import ConfigError
from colocate.pods import standin
from tests.support.workerd import OPERATOR_TOKENS, SECRETS, auth, cell_plan, request, running_cell

PRICE = 100_000.0  # $ per 1M tokens: $0.10 a token, so a few answers reach a cap
MESSAGES = [{"role": "user", "content": "hello there"}]
MAX_TOKENS = 4
BODY = json.dumps({"model": "m", "messages": MESSAGES, "max_tokens": MAX_TOKENS}).encode()
COST = (standin.prompt_tokens({"messages": MESSAGES}) + MAX_TOKENS) * PRICE  # one answer, in millionths of a dollar
WORST = (len(BODY) + MAX_TOKENS) * PRICE  # what the router reserves for one: every body byte a prompt token


def chat(cell, key, data: bytes = BODY):
    return request(cell.url, "POST", "/v1/chat/completions", body=data,
                   headers={"authorization": f"Bearer {key['key']}", "content-type": "application/json"}, timeout=60)


def spent(cell, key) -> int:
    read = auth(OPERATOR_TOKENS["readToken"])
    rows = request(cell.url, "GET", f"/_colocate/usage?key={key['id']}", headers=read).json()["usage"]
    return sum(r["fallback_microusd"] for r in rows)


# --- passthrough names its models ------------------------------------------------------------

def bindings(p) -> dict:
    return {b.name: b.text for b in p.worker.bindings if b.type == "plain_text"}


def test_passthrough_needs_the_models_it_may_send_a_list_priced_once_or_each_priced():
    with pytest.raises(ConfigError, match=r"colocate:fallbackModels: .*passthrough.*must be named"):
        cell_plan(fallbackModel="passthrough")
    listed = bindings(cell_plan(fallbackModel="passthrough", fallbackModels=["m", "served/two"]))
    assert json.loads(listed["FALLBACK_MODELS"]) == {"m": None, "served/two": None} and "FALLBACK_MODEL" not in listed
    each = bindings(cell_plan(fallbackModel="passthrough", fallbackPrice=None,
                              fallbackModels={"cheap": {"input": 0.1, "output": 0.4}, "dear": {"input": 2.5, "output": 10}}))
    assert json.loads(each["FALLBACK_MODELS"])["dear"] == {"input": 2.5, "output": 10}
    assert json.loads(each["FALLBACK_PRICE"]) == {"input": 2.5, "output": 10}  # the dearest prices the rest and the bounds
    with pytest.raises(ConfigError, match=r"colocate:fallbackModels: .*only with colocate:fallbackModel passthrough"):
        cell_plan(fallbackModel="gpt-4o-mini", fallbackModels=["m"])
    with pytest.raises(ConfigError, match=r"colocate:fallbackModels.dear.output"):
        cell_plan(fallbackModel="passthrough", fallbackModels={"dear": {"input": 1, "output": "lots"}})


@pytest.mark.slow
def test_passthrough_buys_only_a_named_model_each_at_its_price():
    dear = {"input": 2 * PRICE, "output": 2 * PRICE}
    with running_cell({"stateTtlMs": 300}, split_tokens=True, fallbackModel="passthrough",
                      fallbackPrice={"input": PRICE, "output": PRICE}, fallbackModels={"m": None, "m-dear": dear},
                      fallbackCap={"cellUsdPerDay": 0}, keys={"defaults": {"fallbackUsdPerDay": 1000}}) as cell:
        key = cell.create_key("passthrough")
        cell.pod.set_fault("error")
        calls = cell.fallback.requests
        res = chat(cell, key, json.dumps({"model": "o1-pro", "messages": MESSAGES, "max_tokens": MAX_TOKENS}).encode())
        assert res.status == 404 and res.headers["x-colocate-backend"] == "none", res.body
        error = res.json()["error"]
        assert (error["code"], error["param"]) == ("model_not_found", "model") and "o1-pro" in error["message"], error
        assert cell.fallback.requests == calls  # never bought
        assert chat(cell, key).headers["x-colocate-backend"] == "fallback"
        dear_body = json.dumps({"model": "m-dear", "messages": MESSAGES, "max_tokens": MAX_TOKENS}).encode()
        assert chat(cell, key, dear_body).headers["x-colocate-backend"] == "fallback"
        assert cell.fallback.seen_bodies[-1]["model"] == "m-dear"
        deadline = time.monotonic() + 15
        while spent(cell, key) < 3 * COST and time.monotonic() < deadline:
            time.sleep(0.1)
        assert spent(cell, key) == round(COST) + round(2 * COST)  # "m" at fallbackPrice, "m-dear" at its own


# --- reserved at the moment the fallback is called ---------------------------------------------

@pytest.mark.slow
def test_eight_requests_at_once_stay_within_a_small_cap():
    """A cap with room for two worst cases, and 8 requests at once while the pods fail: each is
    admitted to the fallback only if its worst case fits beside what is spent and reserved."""
    cap = (2 * WORST + WORST / 2) / 1e6
    with running_cell({"stateTtlMs": 60_000}, split_tokens=True, fallbackPrice={"input": PRICE, "output": PRICE},
                      fallbackCap={"cellUsdPerDay": cap}) as cell:
        keys = [cell.create_key(f"at-once-{i}", fallback_microusd_day=0) for i in range(8)]
        cell.pod.set_fault("error")
        cell.fallback.set_fault("slow", delay_ms=1500)  # all 8 are at the fallback at once
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda k: chat(cell, k), keys))
        bought = [a for a in answers if a.headers["x-colocate-backend"] == "fallback"]
        refused = [a for a in answers if a.status == 429]
        assert len(bought) == 2 and len(refused) == 6, [(a.status, a.headers["x-colocate-backend"]) for a in answers]
        assert all(a.json()["error"]["code"] == "fallback_spend_cap" for a in refused)
        deadline = time.monotonic() + 15
        while sum(spent(cell, k) for k in keys) < 2 * COST and time.monotonic() < deadline:
            time.sleep(0.1)
        assert sum(spent(cell, k) for k in keys) == 2 * round(COST) <= cap * 1e6


# --- every key has a cap of its own -------------------------------------------------------------

@pytest.mark.parametrize("stack", ["apac-jp", "apac-tw", "eu-west", "us-east", "sandbox"])
def test_every_shipped_stack_gives_new_keys_a_fallback_cap_of_their_own(stack):
    raw, _ = stackfile.read_config(stack)
    cap = settings.parse_fallback_cap(raw["fallbackCap"], settings.parse_fallback_price(raw["fallbackPrice"]))
    defaults = settings.parse_key_defaults(raw.get("keys"), cap, settings.parse_fallback_price(raw["fallbackPrice"]))
    assert "fallbackUsdPerDay" in raw["keys"]["defaults"], stack  # said in the stack, not left to the kit's default
    assert 0 < defaults["fallback_microusd_day"] < cap[0] * 1e6, (stack, defaults, cap)


def test_the_default_cap_is_bound_for_the_worker_and_needs_a_price():
    assert bindings(cell_plan())["DEFAULT_FALLBACK_MICROUSD"] == str(2_000_000)
    with pytest.raises(ConfigError, match=r"colocate:keys.defaults.fallbackUsdPerDay: .*colocate:fallbackPrice"):
        settings.parse_key_defaults({"defaults": {"fallbackUsdPerDay": 2}}, (0.0, 0.0), None)
    assert settings.parse_key_defaults({}, (0.0, 0.0), None)["fallback_microusd_day"] == 0  # nothing counted, no cap


@pytest.mark.slow
def test_a_key_made_without_a_cap_gets_the_default_and_cannot_spend_the_cells():
    with running_cell({"stateTtlMs": 60_000}, split_tokens=True, fallbackPrice={"input": PRICE, "output": PRICE},
                      fallbackCap={"cellUsdPerDay": 100 * COST / 1e6},
                      keys={"defaults": {"fallbackUsdPerDay": (COST + WORST + COST / 2) / 1e6}}) as cell:
        key = cell.create_key("default-cap")
        assert key["fallback_microusd_day"] == round(COST + WORST + COST / 2)
        cell.pod.set_fault("error")
        got = [chat(cell, key) for _ in range(3)]
        assert [a.headers["x-colocate-backend"] for a in got] == ["fallback", "fallback", "none"], [a.body for a in got]
        assert "for this key (the key's fallback_microusd_day)" in got[-1].json()["error"]["message"]


# --- a key's cap across a fleet's cells ------------------------------------------------------------

@pytest.mark.slow
def test_a_keys_fallback_cap_holds_across_the_fleets_cells():
    """A key whose fallback is bought in two cells at once (each cell's own address, the pods of
    both failing): the fleet's ledger leases its daily cap L to the cells as it does monthly
    tokens, so together they spend at most L + 10 % (docs/fleet.md), not L in each cell."""
    from tests.support.fleet import running_fleet
    from tests.test_fleet_limits import make_key, told

    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).encode()
    worst = (len(body) + 1) * PRICE
    cap = round(6 * worst)  # millionths of a dollar: room for a few worst cases per cell
    with running_fleet(("apac-jp", "eu-west"), remember_ms=0, exchange_ms=250, fallbackPrice={"input": PRICE, "output": PRICE},
                       fallbackCap={"cellUsdPerDay": 0}) as f:
        told(f)
        key, kid = make_key(f, fallback_microusd_day=cap)
        for c in f.cells:
            c.pod.set_fault("error")
        answers = []
        for _ in range(60):  # bounded: each cell stops at its share
            for c in f.cells:
                answers.append(request(c.url, "POST", "/v1/chat/completions", body=body,
                                       headers={"authorization": f"Bearer {key}", "content-type": "application/json"}))
            if all(a.status == 429 for a in answers[-2 * len(f.cells):]):
                break
        assert {a.status for a in answers} <= {200, 429}
        assert all(a.json()["error"]["code"] == "fallback_spend_cap" for a in answers if a.status == 429)

        def usage_in(c) -> tuple[int, int]:
            rows = request(c.url, "GET", f"/_colocate/usage?key={kid}", headers=auth(SECRETS["PROBE_TOKEN"])).json()["usage"]
            return sum(r["fallback_requests"] for r in rows), sum(r["fallback_microusd"] for r in rows)

        bought = sum(a.status == 200 for a in answers)
        deadline = time.monotonic() + 15  # each cell's isolate flushes within a second
        while sum(usage_in(c)[0] for c in f.cells) < bought and time.monotonic() < deadline:
            time.sleep(0.2)
        total = sum(usage_in(c)[1] for c in f.cells)
        assert total <= cap + max(cap // 10, 1), (total, cap, [usage_in(c) for c in f.cells])
        assert total >= cap // 3, (total, cap)  # and the key got a good part of its cap

