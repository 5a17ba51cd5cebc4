// A generation's migration streams: the successor stages the exporter's pages in its own SQLite
// and merges them a chunk at a time, so what it holds in memory is bounded by a page, whatever
// the generation's size (here 200,000 keys and 30 days of usage), and an import cut short
// resumes without counting anything twice. The real object and SQL (support/objects.js).
import { test } from "node:test";
import assert from "node:assert/strict";
import { objectNamespace } from "./support/objects.js";

const { Breaker, EXPORT_ROWS, MERGE_ROWS, importMemory } = await import("../src/generation.js");

const KEYS = 200_000;
const ACTIVE = 2_000; // keys with usage on each of the 30 days: 60,000 daily rows
const DAYS = 30;

/** The old generation's tables, filled by SQLite itself (no JS array of 200,000 rows). */
async function seeded(ns, name) {
  const g = await ns.instance(name);
  const { sql } = g.ctx.storage;
  sql.exec(`WITH RECURSIVE n(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM n WHERE i < ${KEYS - 1})
    INSERT INTO client_keys (id, hash, prefix, name, rpm, tpm, monthly_tokens, max_parallel, created_at, expires_at,
      revoked_at, fallback_microusd_day, rev)
    SELECT printf('key_%06d', i), printf('%064x', i), 'ck_', 'k', 0, 0, 0, 0, 1, NULL, NULL, 0, i + 1 FROM n`);
  sql.exec(`WITH RECURSIVE k(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM k WHERE i < ${ACTIVE - 1}),
      d(j) AS (SELECT 1 UNION ALL SELECT j + 1 FROM d WHERE j < ${DAYS})
    INSERT INTO usage_daily (day, key_id, requests, prompt_tokens, completion_tokens, pod_requests, fallback_requests,
      estimated_tokens, fallback_microusd)
    SELECT printf('2026-11-%02d', j), printf('key_%06d', i), 3, 100, 50, 3, 0, 0, 0 FROM k, d`);
  sql.exec(`INSERT INTO key_month (key_id, month, tokens) SELECT key_id, '2026-11', SUM(prompt_tokens + completion_tokens)
    FROM usage_daily GROUP BY key_id`);
  g.setMeta("rev", KEYS);
  g.setMeta("scale_desired", JSON.stringify({ pods: 2, draining: 0, owner: "c", at: 1 }));
  return g;
}

function totals(g) {
  const { sql } = g.ctx.storage;
  return {
    keys: sql.exec("SELECT COUNT(*) AS n FROM client_keys").one().n,
    requests: sql.exec("SELECT COALESCE(SUM(requests), 0) AS n FROM usage_daily").one().n,
    days: sql.exec("SELECT COUNT(*) AS n FROM usage_daily").one().n,
    month: sql.exec("SELECT COALESCE(SUM(tokens), 0) AS n FROM key_month").one().n,
    changed: sql.exec("SELECT COUNT(*) AS n FROM key_changed").one().n,
  };
}

test("a migration of 200,000 keys and 30 days of usage holds at most a page in memory", { timeout: 600_000 }, async () => {
  const ns = objectNamespace(Breaker);
  const old = await seeded(ns, "g1");
  const before = totals(old);
  assert.deepEqual([before.keys, before.days, before.requests], [KEYS, ACTIVE * DAYS, ACTIVE * DAYS * 3]);
  importMemory.peakRows = 0;
  const next = ns.get(ns.idFromName("g2"));
  assert.deepEqual(await next.importFrom({ generation: "g2", draining: "g1" }), { imported: true });
  const after = totals(await ns.instance("g2"));
  assert.deepEqual(after, { ...before, changed: ACTIVE });
  // Every page of the export went through the stage, and no page or merge chunk held more rows.
  const pages = ns.calls.filter((c) => c[0] === "exportAll" && c[1] === "g1").length;
  assert.ok(pages >= Math.ceil((KEYS + ACTIVE * DAYS + ACTIVE) / EXPORT_ROWS), `${pages} pages`);
  assert.ok(importMemory.peakRows > 0 && importMemory.peakRows <= Math.max(EXPORT_ROWS, MERGE_ROWS), `${importMemory.peakRows} rows`);
  const g2 = await ns.instance("g2");
  assert.equal(g2.ctx.storage.sql.exec("SELECT COUNT(*) AS n FROM import_stage").one().n, 0); // the stage is emptied
  assert.equal(JSON.parse(g2.meta("scale_desired")).pods, 2); // the controller's count moves with the state
  assert.equal(g2.meta("importing:g1"), null);
});

test("an import cut short resumes at its staged cursor and counts nothing twice", async () => {
  const ns = objectNamespace(Breaker);
  const old = await ns.instance("g1");
  const { sql } = old.ctx.storage;
  const usage = EXPORT_ROWS * 2 + 17; // three pages
  sql.exec(`WITH RECURSIVE n(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM n WHERE i < ${usage - 1})
    INSERT INTO usage_daily (day, key_id, requests, prompt_tokens, completion_tokens, pod_requests, fallback_requests,
      estimated_tokens, fallback_microusd)
    SELECT '2026-11-30', printf('key_%06d', i), 1, 10, 5, 1, 0, 0, 0 FROM n`);
  const realExport = old.exportAll.bind(old);
  let served = 0;
  old.exportAll = async (successor, cursor) => {
    if (++served === 2) throw new Error("the isolate was reset"); // the second page never arrives
    return realExport(successor, cursor);
  };
  const next = ns.get(ns.idFromName("g2"));
  await assert.rejects(next.importFrom({ generation: "g2", draining: "g1" }), /reset/);
  const g2 = await ns.instance("g2");
  assert.equal(g2.ctx.storage.sql.exec("SELECT COUNT(*) AS n FROM usage_daily").one().n, 0); // nothing merged yet
  assert.ok(JSON.parse(g2.meta("importing:g1")).next, "the staged cursor is kept");
  assert.deepEqual(await next.importFrom({ generation: "g2", draining: "g1" }), { imported: true });
  assert.equal(served, 4); // 1 staged + 1 cut + 2 more: the first page was not read again
  const got = g2.ctx.storage.sql.exec("SELECT COUNT(*) AS n, SUM(requests) AS r, SUM(prompt_tokens) AS p FROM usage_daily").one();
  assert.deepEqual([got.n, got.r, got.p], [usage, usage, usage * 10]);
  assert.equal(g2.ctx.storage.sql.exec("SELECT SUM(tokens) AS t FROM key_month").one().t, usage * 15);
});
