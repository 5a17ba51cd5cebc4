"""The generation object at scale, in real workerd: what a sync carries (key rows changed
since the caller's revision, counters of the keys it asks about), key look-ups, requests in
flight across isolates (max_parallel), the schema-2 upgrade in place, and a migration that
keeps usage and month totals. The object is driven directly through bench/gen_driver.js,
as isolates call it, and through the router where the client's view matters."""

import hashlib
import subprocess
import threading
import time

import pytest

from colocate.cell.payloads import COUNTER, EXCHANGE
from tests.support.workerd import ROOT, auth, chat, driven_cell, request, twin_cell

pytestmark = pytest.mark.slow
TODAY = time.strftime("%Y-%m-%d", time.gmtime())


@pytest.fixture(scope="module")
def cell():
    with driven_cell({"stateTtlMs": 60_000}) as c:
        yield c


def info(cell, isolate="iso_a", have_rev=-1, keys=(), **over) -> dict:
    return {"generation": cell.generation, "draining": None, "haveRev": have_rev, "isolate": isolate, "ttlMs": 2000,
            "keys": list(keys), "failureThreshold": 3, "openMs": 30000, "deadlineMs": 2000, **over}


def make_key(cell, name, **limits) -> dict:
    res = request(cell.url, "POST", "/_colocate/keys", body={"name": name, **limits}, headers=auth())
    assert res.status == 201, res.body
    return res.json()


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def test_a_cold_isolate_gets_the_revision_not_the_key_list(cell):
    for i in range(3):
        make_key(cell, f"cold{i}")
    view = cell.one("sync", info(cell), None)
    assert view["keys"] == [] and view["rev"] >= 3 and view["more"] is False


def test_a_sync_carries_only_the_key_rows_changed_since_the_revision_held(cell):
    rev = cell.one("sync", info(cell), None)["rev"]
    assert cell.one("sync", info(cell, have_rev=rev), None)["keys"] is None  # nothing changed
    made = make_key(cell, "delta", rpm=7, max_parallel=3)
    rows = cell.one("sync", info(cell, have_rev=rev), None)["keys"]
    assert [(r["id"], r["rpm"], r["max_parallel"], r["revoked"]) for r in rows] == [(made["id"], 7, 3, False)]
    assert rows[0]["hash"] == digest(made["key"])
    request(cell.url, "POST", f"/_colocate/keys/{made['id']}/revoke", headers=auth())
    rows = cell.one("sync", info(cell, have_rev=rev + 1), None)["keys"]
    assert [(r["id"], r["revoked"]) for r in rows] == [(made["id"], True)]


def test_look_up_finds_a_key_by_digest_and_never_a_revoked_or_unknown_one(cell):
    live = make_key(cell, "look")
    gone = make_key(cell, "gone")
    request(cell.url, "POST", f"/_colocate/keys/{gone['id']}/revoke", headers=auth())
    res = cell.one("lookupKeys", [digest(live["key"]), digest(gone["key"]), "0" * 64], info(cell))
    assert [k["id"] for k in res["keys"]] == [live["id"]]


def test_counters_and_month_totals_only_for_the_keys_asked_about(cell):
    a, b = make_key(cell, "ca"), make_key(cell, "cb")
    minute = int(time.time() * 1000) // 60_000
    batch = {"usage": [[TODAY, a["id"], 2, 10, 5, 2, 0, 0], [TODAY, b["id"], 1, 3, 4, 1, 0, 4]],
             "windows": [[a["id"], minute, 2, 15], [b["id"], minute, 1, 7]]}
    cell.one("sync", info(cell, "iso_1"), batch)
    view = cell.one("sync", info(cell, "iso_2", keys=[a["id"]]), None)
    assert set(view["counts"]) == {a["id"]}
    c = COUNTER.record(view["counts"][a["id"]])
    m, req, tok, month, elsewhere = c["minute"], c["req"], c["tok"], c["month_tokens"], c["inflight"]
    assert (req, tok, month, elsewhere) == (2, 15, 15, 0) and m in (minute, minute + 1)
    later = cell.one("sync", info(cell, "iso_2", keys=[a["id"], b["id"]]),
                     {"usage": [[TODAY, b["id"], 0, 1, 1, 0, 0, 0]]})["counts"]
    assert later[b["id"]][COUNTER["month_tokens"]] == 3 + 4 + 2  # the month total grows with each batch
    usage = {r["key_id"]: r for r in request(cell.url, "GET", "/_colocate/usage", headers=auth()).json()["usage"]}
    assert usage[b["id"]]["estimated_tokens"] == 4 and usage[a["id"]]["estimated_tokens"] == 0


def test_the_counters_a_routed_request_leaves_are_read_back_by_name(cell):
    """The writers (the router's isolate, the object) and the readers (a sync's counts, the
    exchange's rows, Python) agree on every column: one misplaced column fails here."""
    made = make_key(cell, "shape")
    tokens = 0
    for _ in range(3):
        res = request(cell.url, "POST", "/v1/chat/completions", body=chat(), headers={"authorization": f"Bearer {made['key']}"})
        assert res.status == 200, res.body
        tokens += res.json()["usage"]["total_tokens"]
    minute = int(time.time() * 1000) // 60_000
    deadline = time.monotonic() + 30  # the isolate flushes within a second of each request
    while True:
        counts = cell.one("sync", info(cell, "iso_reader", keys=[made["id"]]), None)["counts"].get(made["id"])
        if (counts and counts[COUNTER["req"]] + counts[COUNTER["prev_req"]] == 3) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    c = COUNTER.record(counts)
    assert c["minute"] - minute in (0, 1) and c["req"] + c["prev_req"] == 3 and c["tok"] + c["prev_tok"] == tokens, c
    assert c["month_tokens"] == tokens and c["inflight"] == 0, c
    rows = request(cell.url, "GET", "/_colocate/fleet/counters?since=0", headers=auth()).json()["rows"]
    row = EXCHANGE.record(next(r for r in rows if r[EXCHANGE["key_id"]] == made["id"]))
    assert row["req"] + row["prev_req"] == 3 and row["month_tokens"] == tokens and row["month"] == TODAY[:7], row
    usage = [u for u in request(cell.url, "GET", "/_colocate/usage", headers=auth()).json()["usage"] if u["key_id"] == made["id"]]
    assert [(u["requests"], u["prompt_tokens"] + u["completion_tokens"], u["pod_requests"]) for u in usage] == [(3, tokens, 3)]


def test_requests_in_flight_elsewhere_are_summed_without_the_caller_s_own(cell):
    k = make_key(cell, "par", max_parallel=4)
    cell.rpc([["sync", info(cell, "iso_x"), {"inflight": [[k["id"], 3]]}],
              ["sync", info(cell, "iso_y"), {"inflight": [[k["id"], 1]]}]])
    assert cell.one("sync", info(cell, "iso_z", keys=[k["id"]]), None)["counts"][k["id"]][COUNTER["inflight"]] == 4
    assert cell.one("sync", info(cell, "iso_x", keys=[k["id"]]), None)["counts"][k["id"]][COUNTER["inflight"]] == 1
    cell.one("sync", info(cell, "iso_x"), {"inflight": [[k["id"], 0]]})
    assert cell.one("sync", info(cell, "iso_z", keys=[k["id"]]), None)["counts"][k["id"]][COUNTER["inflight"]] == 1
    # A silent isolate's rows stop counting after 2 x its TTL.
    stale = cell.one("sync", info(cell, "iso_z", keys=[k["id"]], ttlMs=1), None)
    time.sleep(2.1)
    stale = cell.one("sync", info(cell, "iso_z", keys=[k["id"]], ttlMs=1000), None)
    assert k["id"] not in stale["counts"]


def test_a_new_key_works_on_its_first_request_and_its_revocation_reaches_another_isolate_within_the_ttl():
    ttl = 1000
    with twin_cell({"stateTtlMs": ttl}) as tc:
        a, b = tc.urls
        assert request(b, "GET", "/v1/models", headers={"authorization": f"Bearer {tc.key}"}).status == 200
        made = request(a, "POST", "/_colocate/keys", body={"name": "new"}, headers=auth()).json()
        hdr = {"authorization": f"Bearer {made['key']}"}
        assert request(b, "GET", "/v1/models", headers=hdr).status == 200  # looked up on its first request
        assert request(b, "GET", "/v1/models", headers=hdr).headers["server-timing"].startswith("state;dur=0")
        assert request(a, "POST", f"/_colocate/keys/{made['id']}/revoke", headers=auth()).status == 200
        t0 = time.monotonic()
        while request(b, "GET", "/v1/models", headers=hdr).status == 200 and time.monotonic() - t0 < 10:
            time.sleep(0.05)
        took = time.monotonic() - t0
        assert request(b, "GET", "/v1/models", headers=hdr).status == 401
        assert took < 3 * ttl / 1000 + 1, took  # within the TTL, with room for a loaded machine


def test_max_parallel_refuses_the_extra_request_and_an_openai_client_raises_rate_limit_error(openai_client):
    import openai  # here, not at collection: every pytest worker collects every file

    with driven_cell({"stateTtlMs": 60_000}, compute_ms=1500) as c:
        made = make_key(c, "one-at-a-time", max_parallel=1)
        client = openai_client(c.url + "/v1", made["key"])
        first = {}
        t = threading.Thread(target=lambda: first.setdefault("r", request(
            c.url, "POST", "/v1/chat/completions", body=chat(), headers={"authorization": f"Bearer {made['key']}"})))
        t.start()
        deadline = time.monotonic() + 10
        while c.pod.requests == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(openai.RateLimitError) as exc:
            client.chat.completions.create(model="client/model", messages=[{"role": "user", "content": "hi"}])
        assert exc.value.code == "too_many_parallel_requests" and exc.value.type == "requests"
        assert exc.value.response.headers["retry-after"] == "1"
        t.join(30)
        assert first["r"].status == 200
        done = client.chat.completions.create(model="client/model", messages=[{"role": "user", "content": "hi"}])
        assert done.choices[0].message.content


def test_the_cell_default_applies_to_keys_created_without_max_parallel():
    with driven_cell({"stateTtlMs": 60_000}, with_key=False, keys={"defaults": {"maxParallel": 5}}) as c:
        assert make_key(c, "default")["max_parallel"] == 5
        assert make_key(c, "explicit", max_parallel=0)["max_parallel"] == 0


SCHEMA2_COMMIT = "41a22df"  # the last commit with generation schema 2


def test_a_schema_2_object_upgrades_in_place_without_loss(tmp_path):
    old = tmp_path / "old"
    try:
        tar = subprocess.run(
            ["git", "-C", str(ROOT), "archive", SCHEMA2_COMMIT, "worker"], check=True, capture_output=True
        ).stdout
    except (subprocess.CalledProcessError, FileNotFoundError) as exc:
        pytest.skip(f"needs the git history for the schema-2 Worker ({exc})")
    old.mkdir()
    subprocess.run(["tar", "-x", "-C", str(old)], input=tar, check=True)
    from tests.support.workerd import legacy_plan

    old_plan = legacy_plan(old / "worker" / "src", {"stateTtlMs": 60_000})
    assert "SCHEMA_VERSION = \"2\"" in (old / "worker" / "src" / "schema.js").read_text()
    store = tmp_path / "do"
    with driven_cell(plan=old_plan, storage_dir=store) as c:
        kept = make_key(c, "kept", rpm=9)
        gone = make_key(c, "gone")
        request(c.url, "POST", f"/_colocate/keys/{gone['id']}/revoke", headers=auth())
        for _ in range(3):
            assert request(c.url, "POST", "/v1/chat/completions", body=chat(),
                           headers={"authorization": f"Bearer {kept['key']}"}).status == 200
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            before = request(c.url, "GET", "/_colocate/usage", headers=auth()).json()["usage"]
            if sum(r["requests"] for r in before if r["key_id"] == kept["id"]) == 3:
                break
            time.sleep(0.1)
        keys_before = request(c.url, "GET", "/_colocate/keys", headers=auth()).json()["keys"]
    with driven_cell({"stateTtlMs": 60_000}, storage_dir=store, with_key=False) as c:
        keys_after = request(c.url, "GET", "/_colocate/keys", headers=auth()).json()["keys"]
        # columns added since schema 2: 0 for old rows (max_parallel_tokens: none, the cell's default holds)
        added = {"max_parallel": None, "fallback_microusd_day": None, "max_parallel_tokens": None}
        assert [{**k, **added} for k in keys_after] == [{**k, **added} for k in keys_before]
        assert all(k["max_parallel"] == 0 and k["fallback_microusd_day"] == 0 and k["max_parallel_tokens"] is None
                   for k in keys_after)
        after = request(c.url, "GET", "/_colocate/usage", headers=auth()).json()["usage"]
        added = ("estimated_tokens", "fallback_microusd", "refused")  # columns added since schema 2, 0 for old rows
        assert [{k: v for k, v in r.items() if k not in added} for r in after] == before
        assert all(r["fallback_microusd"] == 0 and r["refused"] == 0 for r in after)
        mine = [r for r in after if r["key_id"] == kept["id"]]
        tokens = sum(r["prompt_tokens"] + r["completion_tokens"] for r in mine)
        assert tokens > 0
        view = c.one("sync", info(c, keys=[kept["id"]]), None)
        assert view["counts"][kept["id"]][COUNTER["month_tokens"]] == tokens  # the month total, filled once from the daily rows
        hdr = {"authorization": f"Bearer {kept['key']}"}
        assert request(c.url, "GET", "/v1/models", headers=hdr).status == 200
        assert request(c.url, "GET", "/v1/models", headers={"authorization": f"Bearer {gone['key']}"}).status == 401


def test_a_migration_keeps_usage_month_totals_and_keys(tmp_path):
    with driven_cell({"stateTtlMs": 60_000}, with_key=False) as c:
        g1, g2 = "us-east.m1", "us-east.m2"
        row = {"id": "key_aaaaaaaaaaaa", "hash": "ab" * 32, "prefix": "clc_xxxxxx", "name": "moved", "rpm": 0, "tpm": 0,
               "monthly_tokens": 100, "max_parallel": 2, "max_parallel_tokens": 4096, "created_at": 1, "expires_at": None}
        c.one("createKey", row, {"generation": g1}, gen=g1)
        c.one("sync", {"generation": g1, "haveRev": -1, "isolate": "i", "keys": []},
              {"usage": [[TODAY, row["id"], 4, 30, 20, 4, 0, 5]]}, gen=g1)
        view = c.one("sync", {"generation": g2, "draining": g1, "haveRev": -1, "isolate": "i", "keys": [row["id"]]}, None, gen=g2)
        assert view["imported"] == [g1]
        assert view["counts"][row["id"]][COUNTER["month_tokens"]] == 50
        found = c.one("lookupKeys", ["ab" * 32], {"generation": g2}, gen=g2)["keys"]
        assert [(k["id"], k["max_parallel"], k["max_parallel_tokens"], k["monthly_tokens"]) for k in found] == [
            (row["id"], 2, 4096, 100)]
        usage = c.one("usage", {"from": TODAY, "to": TODAY, "key": row["id"]}, {"generation": g2}, gen=g2)
        assert [(u["requests"], u["prompt_tokens"], u["completion_tokens"], u["estimated_tokens"]) for u in usage] == [
            (4, 30, 20, 5)
        ]


def test_a_migration_pages_the_export_and_imports_every_row(tmp_path):
    # A generation's history is read a page at a time (at most EXPORT_ROWS rows a call, from
    # as many tables as fit, each row with its rowid: the cursor), never in one answer that
    # could pass what an RPC carries, nor in a call per table; the successor imports it all,
    # in the background once it is more than a page (its alarm), serving meanwhile.
    rows = 5000 + 1234  # more than one page (migration.js EXPORT_ROWS)
    with driven_cell({"stateTtlMs": 60_000}, with_key=False) as c:
        g0, g1, g2 = "us-east.p0", "us-east.p1", "us-east.p2"
        c.one("sync", {"generation": g0, "haveRev": -1, "isolate": "i", "keys": []}, None, gen=g0)
        empty = c.one("exportAll", None, None, gen=g0)  # a small generation: one call, every table
        assert empty["next"] is None and [(len(r), len(ids)) for _, r, ids in empty["parts"]] == [(0, 0)] * 11
        assert [name for name, _, _ in empty["parts"]][:2] == ["keys", "leases"]
        usage = [[TODAY, f"key_{i:012d}", 1, 2, 3, 1, 0, 0] for i in range(rows)]
        c.one("sync", {"generation": g1, "haveRev": -1, "isolate": "i", "keys": []}, {"usage": usage}, gen=g1)
        page = c.one("exportAll", None, None, gen=g1)
        assert [(name, len(r)) for name, r, _ in page["parts"]] == [
            ("keys", 0), ("leases", 0), ("peers", 0), ("windows", 0), ("inflight", 0), ("months", 5000)]
        assert page["next"] == {"part": 5, "after": page["parts"][-1][2][-1]}
        pages = [page]
        while pages[-1]["next"] and len(pages) < 20:
            pages.append(c.one("exportAll", None, pages[-1]["next"], gen=g1))
        assert pages[-1]["next"] is None
        sizes = [sum(len(r) for _, r, _ in p["parts"]) for p in pages]
        assert all(n == 5000 for n in sizes[:-1]) and 0 < sizes[-1] <= 5000  # every page full but the last
        got = [r["key_id"] for p in pages for name, rs, _ in p["parts"] if name == "usage" for r in rs]
        assert sorted(got) == sorted(u[1] for u in usage)
        # The successor answers at once and imports every page by its alarm.
        view = c.one("sync", {"generation": g2, "draining": g1, "haveRev": -1, "isolate": "i", "keys": []}, None, gen=g2)
        assert view["imported"] == [] and view["importing"][0]["total"] == 2 * rows  # key_month's rows and usage's
        deadline = time.monotonic() + 60
        while g1 not in view["imported"] and time.monotonic() < deadline:
            time.sleep(0.1)
            view = c.one("sync", {"generation": g2, "draining": g1, "haveRev": -1, "isolate": "i", "keys": []}, None, gen=g2)
        assert view["imported"] == [g1] and "importing" not in view
        moved = c.one("usage", {"from": TODAY, "to": TODAY, "key": f"key_{rows - 1:012d}"}, {"generation": g2}, gen=g2)
        assert [(u["requests"], u["prompt_tokens"]) for u in moved] == [(1, 2)]
        everything = c.one("usage", {"from": TODAY, "to": TODAY}, {"generation": g2}, gen=g2)
        assert len(everything) == rows and sum(u["requests"] for u in everything) == rows
