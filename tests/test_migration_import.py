"""A large generation's migration in real workerd: the new generation serves from its first
request while it imports the draining one in chunks; a crash of workerd in the middle resumes
from the cursor (the object's alarm, no call needed); every row and request counts once; and
`migrate.py status` and `finish` say how far the import is, `finish` refusing until it is done.

The same run at full size (200,000 keys, 500,000 seg_minute rows) is `make bench-migration`
(bench/migration.py); here it is a tenth of that, so it fits `make test`.
"""

from __future__ import annotations

import argparse
import shutil
import time

import pytest

from bench import migration as bench
from colocate import stackfile
from scripts import migrate
from tests.support.workerd import SECRETS, driven_cell

pytestmark = pytest.mark.slow


def test_a_large_migration_completes_through_a_crash_with_every_request_served_and_every_row_once():
    # restart_at is low so the crash lands mid-import even on a fast machine: the requests
    # pause 1.5 s before it (their usage flushed), and the import goes on meanwhile. after_s: a
    # second of requests once the import is done (the benchmark's 10 s are for its latency figure,
    # which nothing here checks); those count too, each once, in the new generation alone.
    opts = argparse.Namespace(keys=20_000, usage_rows=10_000, seg_rows=50_000, rate=10.0, restart_at=0.1, after_s=1.0,
                              timeout=600)
    r = bench.run(opts, log=lambda m: None)
    print(bench.render(r))
    assert r["completed"], r["timeline"]
    assert r["requests"] > 0 and r["failed"] == 0, r["failures"]
    assert isinstance(r["killed_at_rows"], int) and r["killed_at_rows"] < r["rows"], "the crash came after the import"
    # Resumed from its cursor, not from the start, and by the alarm alone: no call reached the object.
    assert isinstance(r["resumed_at_rows"], int) and r["resumed_at_rows"] >= r["killed_at_rows"]
    alone = r["alarm_alone_rows"]
    assert alone == "done" or alone > r["resumed_at_rows"], (r["resumed_at_rows"], alone)
    c = r["client_requests"]
    assert c["counted"] == c["seeded"] + c["sent"], c  # each request once, through the crash
    g1, g2 = r["tables"]["g1"], r["tables"]["g2"]
    assert g2["seg_minute"] == g1["seg_minute"] == opts.seg_rows
    assert g2["client_keys"] == g1["client_keys"] == opts.keys + 1
    assert g2["usage_daily"] == g1["usage_daily"] and g2["key_month"] == g1["key_month"]
    assert g2["import_pulled"] == 0
    assert r["ok"]


@pytest.fixture
def stacks(tmp_path):
    for p in stackfile.STACKS_DIR.glob("Pulumi.*.yaml"):
        shutil.copy(p, tmp_path / p.name)
    return tmp_path


MOVED = [{"name": "us-east.g1", "region": "us-east", "status": "draining"},
         {"name": "us-east.g2", "region": "us-east", "status": "active"}]


def test_status_says_how_far_the_import_is_and_finish_waits_for_it(stacks, monkeypatch, capsys):
    stackfile.write_config("sandbox", {"generations": MOVED}, stacks)
    before = (stacks / "Pulumi.sandbox.yaml").read_bytes()
    monkeypatch.setenv("COLOCATE_READ_TOKEN", SECRETS["PROBE_TOKEN"])
    # 40,000 rows (two seeding calls of 20,000): 8 pages of the import's 5,000 (a generation of at
    # most one page comes whole), over a second of merging here, while finish asks a fraction of a
    # second after status started it (it found 1,000 rows of 60,000 merged on a loaded machine).
    rows = 40_000
    with driven_cell({"stateTtlMs": 60_000}, generations=MOVED, with_key=False) as c:
        minute = int(time.time()) // 60 - 3 * 24 * 60
        for start in range(0, rows, 20_000):
            c.one("importState", f"seed-{start}", {"seg_minute": [[minute + i // 20, "IAD", str(i % 20), "total", "~200*2"]
                                                                   for i in range(start, start + 20_000)]}, gen="us-east.g1")
        flags = ["--stack", "sandbox", "--stacks-dir", str(stacks), "--url", c.url]
        assert migrate.main(["status", *flags]) == 0  # its question is the import's first touch
        out = capsys.readouterr().out
        assert "us-east.g2 has imported" in out and f"of {rows:,} rows" in out and "finish" in out, out
        assert migrate.main(["finish", *flags]) == 2
        err = capsys.readouterr().err
        assert "us-east.g2 has imported" in err and "us-east.g1" in err and "status --stack sandbox" in err, err
        assert (stacks / "Pulumi.sandbox.yaml").read_bytes() == before  # refused: nothing written
        deadline = time.monotonic() + 300
        while migrate.main(["finish", *flags]) != 0 and time.monotonic() < deadline:
            time.sleep(0.5)
        out = capsys.readouterr().out
        assert "us-east.g1 retires" in out, out
    raw, _ = stackfile.read_config("sandbox", stacks)
    assert [g["status"] for g in raw["generations"]] == ["retired", "active"]

