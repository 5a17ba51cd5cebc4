"""One key for the whole fleet: scripts/keys.py on a fleet stack, against real cells in workerd.

The cells are found as keys.py finds any cell: a fleet stack file names them, and each has
a running sandbox's ready.json (URL and probe token) in --sandboxes-dir. A cell "down" is
its ready.json pointing at a closed port.
"""

from __future__ import annotations

import json
import re
import shlex
import socket
import time
from pathlib import Path

import pytest

from colocate import admin
from colocate.cli import ROOT
from scripts import keys
from tests.support.fleet import Fleet, running_fleet
from tests.support.workerd import SECRETS, auth, request

CELLS = ("apac-jp", "eu-west")
COLO = {"apac-jp": "NRT", "eu-west": "FRA"}  # the colo each cell is nearest to
STATE_TTL_S = 2  # colocate:worker.stateTtlMs default: the revocation bound in each cell
HEX64 = re.compile(r"[0-9a-f]{64}")


# --- pure parts ---

def test_a_key_made_here_has_the_workers_format_and_only_its_digest_travels():
    key = admin.new_key()
    assert re.fullmatch(r"clc_[A-Za-z0-9_-]{32}", key)
    row = admin.key_row(key, "acme", rpm=5, expires_in_s=60, now_ms=1_000)
    assert re.fullmatch(r"key_[0-9a-f]{12}", row["id"]) and HEX64.fullmatch(row["hash"])
    assert row["hash"] == admin.key_hash(key) and row["prefix"] == key[:10]
    assert key not in json.dumps(row)
    assert row["expires_at"] == 61_000 and row["created_at"] == 1_000 and "max_parallel" not in row
    assert admin.key_row(key, "a", max_parallel=0)["max_parallel"] == 0
    assert admin.new_key() != key and admin.new_key_id() != row["id"]


def _row(key_id, digest, revoked=None):
    return {"id": key_id, "hash": digest, "prefix": "clc_abcdef", "name": "n", "rpm": 0, "tpm": 0, "monthly_tokens": 0,
            "max_parallel": 0, "created_at": 1, "expires_at": None, "revoked_at": revoked}


def test_plan_sync_copies_missing_keys_carries_revocations_and_leaves_conflicts():
    a, b, c = "a" * 64, "b" * 64, "c" * 64
    plan = admin.plan_sync({
        "x": [_row("key_1", a), _row("key_2", b, revoked=5), _row("key_3", c), _row("key_4", a[:-1] + "f")],
        "y": [_row("key_2", b), _row("key_3", c, revoked=7)],
        "z": [_row("key_4", "d" * 64)],
    })
    assert [(cell, r["id"]) for cell, r in plan["imports"]] == [("y", "key_1"), ("z", "key_1")]
    assert plan["imports"][0][1]["hash"] == a and "revoked_at" not in plan["imports"][0][1]
    assert sorted(plan["revokes"]) == [("x", "key_3"), ("y", "key_2")]  # revocation wins; z lacks both: nothing
    assert plan["conflicts"] == ["key_4"]
    # A cell did not answer: it may hold a revocation, so nothing is copied; revocations still are.
    partial = admin.plan_sync({"x": [_row("key_1", a), _row("key_2", b, 5)], "y": [_row("key_2", b)]}, complete=False)
    assert partial == {"imports": [], "revokes": [("y", "key_2")], "conflicts": []}
    # One digest under two ids: a conflict while active anywhere, nothing once revoked everywhere.
    assert admin.plan_sync({"x": [_row("key_1", a)], "y": [_row("key_9", a)]})["conflicts"] == ["key_1", "key_9"]
    assert admin.plan_sync({"x": [_row("key_1", a, 1)], "y": [_row("key_9", a, 2)]}) == {
        "imports": [],
        "revokes": [],
        "conflicts": [],
    }
    assert admin.plan_sync({"x": [_row("key_1", a)], "y": [_row("key_1", a)]}) == {"imports": [], "revokes": [], "conflicts": []}


def test_fleet_usage_rows_per_key_and_cell_then_all_cells_then_total():
    def u(key_id, n):
        return {"key_id": key_id, "name": key_id, "requests": n, "prompt_tokens": 10 * n, "completion_tokens": n,
                "pod_requests": n, "fallback_requests": 0}

    rows = keys.fleet_usage_rows(CELLS, {"apac-jp": {"usage": [u("k1", 2), u("k1", 1), u("k2", 4)]},
                                         "eu-west": {"usage": [u("k1", 5)]}})
    got = [(r["key_id"], r["cell"], r["requests"]) for r in rows]
    assert got == [("k1", "apac-jp", 3), ("k1", "eu-west", 5), ("k1", "all", 8), ("k2", "apac-jp", 4), ("k2", "all", 4),
                   ("total", "all", 12)]
    assert rows[-1]["prompt_tokens"] == 120


def test_a_fleet_stack_is_told_from_a_cell_by_its_file(tmp_path):
    (tmp_path / "Pulumi.fl.yaml").write_text("config:\n  colocate:fleet:\n    cells: [apac-jp, eu-west]\n")
    (tmp_path / "Pulumi.cell.yaml").write_text("config:\n  colocate:region: apac-jp\n")
    assert admin.fleet_cells("fl", tmp_path) == ("apac-jp", "eu-west")
    assert admin.fleet_cells("cell", tmp_path) is None
    assert admin.fleet_cells("absent", tmp_path) is None
    (tmp_path / "Pulumi.self.yaml").write_text("config:\n  colocate:fleet:\n    cells: [self]\n")
    with pytest.raises(Exception, match=r"colocate:fleet.cells\[0\]"):
        admin.fleet_cells("self", tmp_path)


def test_sync_on_a_cell_stack_is_a_usage_error(tmp_path, capsys):
    (tmp_path / "Pulumi.cell.yaml").write_text("config:\n  colocate:region: apac-jp\n")
    assert keys.main(["sync", "--stack", "cell", "--stacks-dir", str(tmp_path)]) == 2
    assert "not one" in capsys.readouterr().err


# --- real cells ---

@pytest.fixture(scope="module")
def fl(tmp_path_factory) -> Fleet:
    with running_fleet(CELLS, remember_ms=0) as f:
        yield f


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, fl) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("fleetkeys")
    stacks, boxes = root / "stacks", root / "sandboxes"
    stacks.mkdir()
    (stacks / "Pulumi.fl.yaml").write_text("config:\n  colocate:fleet:\n    cells: [apac-jp, eu-west]\n")
    for c in fl.cells:
        point(boxes, c.name, c.url)
        # The support's key is one key stored per cell under different ids (not a replica):
        # retire it so the fleet starts consistent.
        client = admin.AdminClient(admin.Target(c.url, SECRETS["PROBE_TOKEN"], "url"))
        for k in client.list_keys():
            client.revoke_key(k["id"])
    return stacks, boxes


def point(boxes: Path, cell: str, url: str) -> None:
    (boxes / cell).mkdir(parents=True, exist_ok=True)
    (boxes / cell / "ready.json").write_text(json.dumps({"worker_url": url, "token": SECRETS["PROBE_TOKEN"]}))


def closed_port_url() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"http://127.0.0.1:{port}"


@pytest.fixture
def run(dirs, capsys):
    stacks, boxes = dirs

    def run(*argv: str) -> tuple[int, str, str]:
        code = keys.main([*argv, "--stack", "fl", "--stacks-dir", str(stacks), "--sandboxes-dir", str(boxes)])
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


def statuses(fl: Fleet, key: str) -> dict[str, int]:
    """Each cell's answer to the key, through the front door at the colo nearest to it."""
    out = {}
    for cell, colo in COLO.items():
        res = fl.call(colo, "GET", "/v1/models", headers={"authorization": f"Bearer {key}"})
        if res.status == 200:
            assert res.headers["x-colocate-cell"] == cell
        out[cell] = res.status
    return out


def until(fn, want, within_s: float):
    """Poll ``fn`` until it returns ``want`` or ``within_s`` passes (bounded); its last value."""
    deadline = time.monotonic() + within_s
    while True:
        got = fn()
        if got == want or time.monotonic() > deadline:
            return got
        time.sleep(0.1)


@pytest.mark.slow
def test_a_key_made_once_works_at_every_cell_and_a_revocation_reaches_every_cell(fl, run):
    code, out, err = run("create", "--name", "acme", "--rpm", "600")
    assert code == 0, err
    key = out.strip()
    assert key.startswith("clc_") and key not in err and "2 of 2 cells" in err
    assert statuses(fl, key) == {"apac-jp": 200, "eu-west": 200}
    # Seen once, the key waits 0 ms on state in each cell: each reads only its own copy.
    for cell, colo in COLO.items():
        waits = []
        for _ in range(20):
            res = fl.call(colo, headers={"authorization": f"Bearer {key}"})
            assert res.status == 200 and res.headers["x-colocate-cell"] == cell
            waits.append(res.timing()["state"])
        assert waits == [0] * 20, (cell, waits)
    code, out, err = run("list", "--json")
    row = next(r for r in json.loads(out)["keys"] if r["name"] == "acme")
    assert code == 0 and row["cells"] == {"apac-jp": "active", "eu-west": "active"} and row["rpm"] == 600
    code, out, err = run("revoke", row["id"])
    assert code == 0 and "apac-jp, eu-west" in out, err
    # Each cell refuses it within its state TTL (slack for a loaded machine; the loop is bounded).
    assert until(lambda: statuses(fl, key), {"apac-jp": 401, "eu-west": 401}, 5 * STATE_TTL_S) == {"apac-jp": 401, "eu-west": 401}
    code, out, _ = run("list", "--json")
    assert next(r for r in json.loads(out)["keys"] if r["id"] == row["id"])["cells"] == {
        "apac-jp": "revoked",
        "eu-west": "revoked",
    }


@pytest.mark.slow
def test_a_cell_down_during_create_is_named_and_the_printed_command_finishes(fl, run, dirs):
    _, boxes = dirs
    point(boxes, "eu-west", closed_port_url())
    try:
        code, out, err = run("create", "--name", "half")
    finally:
        point(boxes, "eu-west", fl.cell("eu-west").url)
    key = out.strip()
    assert code == 1 and key.startswith("clc_")
    assert "cell eu-west:" in err and "NOT in: eu-west" in err and "in: apac-jp" in err
    finish = re.search(r"to finish, once those cells answer: (.+)", err).group(1)
    argv = shlex.split(finish)
    # Absolute paths (colocate/cli.script), so the line works pasted in any directory.
    assert argv[:3] == [str(ROOT / ".venv" / "bin" / "python"), str(ROOT / "scripts" / "keys.py"), "sync"]
    assert statuses(fl, key) == {"apac-jp": 200, "eu-west": 401}
    code, out, _ = run("list")
    assert code == 1  # the cells disagree, and it says so
    # The printed command, as printed (it names this fleet's directories itself).
    assert keys.main(argv[2:]) == 0
    assert until(lambda: statuses(fl, key), {"apac-jp": 200, "eu-west": 200}, 5 * STATE_TTL_S) == {"apac-jp": 200, "eu-west": 200}
    code, out, err = run("sync")
    assert code == 0 and "agree on every key" in err
    code, out, _ = run("list")
    assert code == 0


@pytest.mark.slow
def test_a_cell_down_during_revoke_is_named_and_rerunning_finishes(fl, run, dirs):
    _, boxes = dirs
    code, out, _ = run("create", "--name", "gone", "--json")
    made = json.loads(out)
    point(boxes, "apac-jp", closed_port_url())
    try:
        code, out, err = run("revoke", made["id"])
    finally:
        point(boxes, "apac-jp", fl.cell("apac-jp").url)
    assert code == 1 and "NOT in: apac-jp" in err and f"revoke {made['id']} --stack fl" in err
    assert statuses(fl, made["key"])["apac-jp"] == 200  # not silently: it still works there, as reported
    code, out, err = run("sync")  # carries the revocation to the cell that missed it
    assert code == 0 and f"revoked {made['id']} in apac-jp" in out, err
    assert until(lambda: statuses(fl, made["key"]), {"apac-jp": 401, "eu-west": 401}, 5 * STATE_TTL_S) == \
        {"apac-jp": 401, "eu-west": 401}


@pytest.mark.slow
def test_usage_per_key_and_cell(fl, run):
    code, out, _ = run("create", "--name", "metered", "--json")
    made = json.loads(out)
    fl.key = made["key"]
    for colo in ("NRT", "NRT", "FRA"):
        assert fl.call(colo).status == 200

    def counts():
        _, out, _ = run("usage", "--key", made["id"], "--json")
        return {r["cell"]: r["requests"] for r in json.loads(out)["usage"] if r["key_id"] == made["id"]}

    assert until(counts, {"apac-jp": 2, "eu-west": 1, "all": 3}, 10 * STATE_TTL_S) == {"apac-jp": 2, "eu-west": 1, "all": 3}
    code, out, _ = run("usage", "--key", made["id"])
    assert code == 0 and re.search(r"metered\s+apac-jp\s+2\b", out) and re.search(r"metered\s+all\s+3\b", out)


@pytest.mark.slow
def test_bad_input_is_a_usage_error_naming_the_field_and_makes_nothing(fl, run):
    code, out, err = run("create", "--name", "neg", "--max-parallel", "-1")
    assert (code, out) == (2, "") and "max_parallel" in err and "-1" in err
    code, out, _ = run("list", "--json")
    assert "neg" not in [k["name"] for k in json.loads(out)["keys"]]


@pytest.mark.slow
def test_the_replica_endpoint_is_idempotent_refuses_a_conflict_and_names_bad_fields(fl):
    url = fl.cell("apac-jp").url
    row = admin.key_row(admin.new_key(), "direct")
    first = request(url, "POST", "/_colocate/keys/replica", body=row, headers=auth())
    again = request(url, "POST", "/_colocate/keys/replica", body=row, headers=auth())
    assert (first.status, again.status) == (201, 200) and first.json() == again.json()
    assert "hash" not in first.json() and first.json()["id"] == row["id"]
    other = request(url, "POST", "/_colocate/keys/replica", body={**row, "hash": "0" * 64}, headers=auth())
    assert other.status == 409 and other.json()["error"]["code"] == "key_conflict"
    same_digest = request(url, "POST", "/_colocate/keys/replica", body={**row, "id": "key_" + "0" * 12}, headers=auth())
    assert same_digest.status == 409
    for field, bad in (("hash", "xyz"), ("id", "key_1"), ("prefix", "nope"), ("rpm", -1), ("created_at", None),
                       ("name", ""), ("extra", 1)):
        res = request(url, "POST", "/_colocate/keys/replica", body={**row, field: bad}, headers=auth())
        assert res.status == 400 and f'"{field}"' in res.json()["error"]["message"], (field, res.body)
    assert request(url, "POST", "/_colocate/keys/replica", body=row).status == 401
    listed = request(url, "GET", "/_colocate/keys/replica", headers=auth()).json()["keys"]
    assert next(k for k in listed if k["id"] == row["id"])["hash"] == row["hash"]
    assert request(url, "GET", "/_colocate/keys/replica").status == 401
