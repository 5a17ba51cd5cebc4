// A generation's migration runs beside the new generation's traffic: the successor answers
// once it holds the exporter's head, imports the rows by its alarm a chunk per transaction
// with the cursor (a page in memory, whatever the size: here 20,000 keys and 30 days of usage,
// 82,000 rows in 17 pages; the full size, 200,000 keys, is `make bench-migration`), resumes
// after a failure or a reset without counting anything twice, and fetches the rows of the keys
// a call needs ahead of the import. The real object and SQL (support/objects.js); the alarm is
// run by the test, as the runtime would run it when due.
import { test } from "node:test";
import assert from "node:assert/strict";
import { objectNamespace } from "./support/objects.js";
import { handle } from "../src/router.js";
import { keyHash, newKey } from "../src/keys.js";

const { Breaker, EXPORT_ROWS, MERGE_ROWS, importMemory } = await import("../src/generation.js");

const KEYS = 20_000;
const ACTIVE = 2_000; // keys with usage on each of the 30 days: 60,000 daily rows
const DAYS = 30;
const DAY = new Date().toISOString().slice(0, 10);
const MONTH = DAY.slice(0, 7);
const minute = () => Math.floor(Date.now() / 60000);

/** The old generation's tables, filled by SQLite itself (no JS array of 20,000 rows). */
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

const info = (over = {}) => ({ generation: "g2", draining: "g1", haveRev: -1, isolate: "iso", keys: [], ttlMs: 1000, ...over });

/** Run the successor's alarm until none is set (bounded); how many runs it took. */
async function drain(ns, name, max = 1000) {
  let runs = 0;
  while (runs < max && (await ns.alarm(name))) runs++;
  return runs;
}

test("a migration of 20,000 keys and 30 days of usage is served from its first call and imported a chunk per transaction", { timeout: 600_000 }, async () => {
  const ns = objectNamespace(Breaker);
  const old = await seeded(ns, "g1");
  const before = totals(old);
  assert.deepEqual([before.keys, before.days, before.requests], [KEYS, ACTIVE * DAYS, ACTIVE * DAYS * 3]);
  importMemory.peakRows = 0;
  const next = ns.get(ns.idFromName("g2"));
  // The first call waits for the head alone: nothing of the rows is merged when it answers.
  const first = await next.sync(info(), null);
  assert.equal(first.importing.length, 1);
  assert.deepEqual([first.importing[0].from, first.importing[0].rows, first.importing[0].total],
    ["g1", 0, KEYS + ACTIVE * DAYS + ACTIVE]);
  const g2 = await ns.instance("g2");
  const transactions = { n: 0 };
  const real = g2.ctx.storage.transactionSync;
  g2.ctx.storage.transactionSync = (fn) => { transactions.n++; return real(fn); };
  assert.ok((await drain(ns, "g2")) >= 1);
  assert.deepEqual(totals(g2), { ...before, changed: ACTIVE });
  // Every page went through the import, no page held more rows, and no transaction merged more than a chunk.
  const pages = ns.calls.filter((c) => c[0] === "exportAll" && c[1] === "g1").length;
  assert.ok(pages >= Math.ceil((KEYS + ACTIVE * DAYS + ACTIVE) / EXPORT_ROWS), `${pages} pages`);
  assert.ok(importMemory.peakRows > 0 && importMemory.peakRows <= EXPORT_ROWS, `${importMemory.peakRows} rows`);
  assert.ok(transactions.n >= (KEYS + ACTIVE * DAYS + ACTIVE) / MERGE_ROWS, `${transactions.n} transactions`);
  assert.equal(JSON.parse(g2.meta("scale_desired")).pods, 2); // the controller's count moves with the state
  assert.equal(g2.meta("importing:g1"), null);
  const view = await next.sync(info(), null);
  assert.deepEqual([view.imported, view.importing], [["g1"], undefined]);
  assert.equal(g2.ctx.storage.sql.exec("SELECT COUNT(*) AS n FROM import_pulled").one().n, 0); // emptied at the end
});

test("an import cut short by a failed page, then by a reset, resumes at its cursor and counts nothing twice", async () => {
  const ns = objectNamespace(Breaker);
  const old = await ns.instance("g1");
  const { sql } = old.ctx.storage;
  const usage = EXPORT_ROWS * 2 + 17; // three pages
  sql.exec(`WITH RECURSIVE n(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM n WHERE i < ${usage - 1})
    INSERT INTO usage_daily (day, key_id, requests, prompt_tokens, completion_tokens, pod_requests, fallback_requests,
      estimated_tokens, fallback_microusd)
    SELECT '2026-11-30', printf('key_%06d', i), 1, 10, 5, 1, 0, 0, 0 FROM n`);
  sql.exec("INSERT INTO key_month (key_id, month, tokens) SELECT key_id, '2026-11', 15 FROM usage_daily");
  const realExport = old.exportAll.bind(old);
  let served = 0;
  old.exportAll = async (successor, cursor) => {
    if (++served === 2) throw new Error("the exporter was reset"); // the second page never arrives
    return realExport(successor, cursor);
  };
  const next = ns.get(ns.idFromName("g2"));
  await next.sync(info(), null);
  assert.equal(await ns.alarm("g2"), true); // one run: a page merged, then the failure
  const g2 = await ns.instance("g2");
  const cut = JSON.parse(g2.meta("importing:g1"));
  assert.equal(cut.rows, EXPORT_ROWS); // the first page is in, and its cursor with it
  assert.ok((await g2.ctx.storage.getAlarm()) > Date.now(), "the alarm waits before it tries again");
  // The object is reset: the new instance's first call finds the import under way and resumes it.
  ns.reset("g2");
  await ns.get(ns.idFromName("g2")).sync(info(), null);
  await drain(ns, "g2");
  // The first page was not read again: the cut one, then the rest (key_month's rows and usage's).
  assert.equal(served, 1 + Math.ceil((2 * usage) / EXPORT_ROWS));
  const g2b = await ns.instance("g2");
  const got = g2b.ctx.storage.sql.exec("SELECT COUNT(*) AS n, SUM(requests) AS r, SUM(prompt_tokens) AS p FROM usage_daily").one();
  assert.deepEqual([got.n, got.r, got.p], [usage, usage, usage * 10]);
  assert.equal(g2b.ctx.storage.sql.exec("SELECT SUM(tokens) AS t FROM key_month").one().t, usage * 15);
});

test("two runs of the import over the same storage (an evicted instance still running) apply each chunk once", async () => {
  const ns = objectNamespace(Breaker);
  const old = await ns.instance("g1");
  const rows = EXPORT_ROWS * 3;
  old.ctx.storage.sql.exec(`WITH RECURSIVE n(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM n WHERE i < ${rows - 1})
    INSERT INTO usage_daily (day, key_id, requests, prompt_tokens, completion_tokens, pod_requests, fallback_requests,
      estimated_tokens, fallback_microusd)
    SELECT '2026-11-30', printf('key_%06d', i), 1, 10, 5, 1, 0, 0, 0 FROM n`);
  await ns.get(ns.idFromName("g2")).sync(info(), null);
  const first = await ns.instance("g2");
  ns.reset("g2");
  const second = await ns.instance("g2");
  // Both instances run the import at once, each from the cursor it read.
  await Promise.all([first.alarm(), second.alarm(), first.alarm()]);
  await drain(ns, "g2");
  const got = second.ctx.storage.sql.exec("SELECT COUNT(*) AS n, SUM(requests) AS r FROM usage_daily").one();
  assert.deepEqual([got.n, got.r], [rows, rows]);
  assert.notEqual(second.meta("imported:g1"), null);
});

test("while the import runs, calls get the rows they need from the draining generation, each counted once", async () => {
  const ns = objectNamespace(Breaker);
  const old = await ns.instance("g1");
  const key = (id, hash, revoked = null) => ({ id, hash, prefix: "ck_", name: id, rpm: 0, tpm: 0, monthly_tokens: 1000,
    max_parallel: 0, created_at: 1, expires_at: null, revoked_at: revoked, fallback_microusd_day: 0 });
  old.importState("seed", {
    forced: "open",
    keys: [key("key_a", "a".repeat(64)), key("key_b", "b".repeat(64)), key("key_r", "c".repeat(64), 5)],
    usage: [{ day: DAY, key_id: "key_a", requests: 5, prompt_tokens: 40, completion_tokens: 10, pod_requests: 0,
      fallback_requests: 5, estimated_tokens: 0, fallback_microusd: 700 },
    { day: DAY, key_id: "key_b", requests: 2, prompt_tokens: 4, completion_tokens: 1, pod_requests: 2,
      fallback_requests: 0, estimated_tokens: 0, fallback_microusd: 0 }],
    months: [{ key_id: "key_a", month: MONTH, tokens: 50 }, { key_id: "key_b", month: MONTH, tokens: 5 }],
    windows: [{ key_id: "key_a", minute: minute(), requests: 5, tokens: 50 }],
  });
  old.ctx.storage.sql.exec("INSERT INTO fallback_spend (day, microusd) VALUES (?, 700)", DAY);
  // More than a page in all (a smaller generation comes whole with its head): the live view's minutes.
  old.ctx.storage.sql.exec(`WITH RECURSIVE n(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM n WHERE i < ${EXPORT_ROWS})
    INSERT INTO seg_minute (minute, colo, pod, segment, hist) SELECT 1000 + i, 'IAD', '0', 'total', '~200*2' FROM n`);
  // The exporter's pages wait for the test: the import stays under way as long as it needs.
  let open;
  const gate = new Promise((resolve) => { open = resolve; });
  const realExport = old.exportAll.bind(old);
  old.exportAll = async (successor, cursor) => {
    await gate;
    return realExport(successor, cursor);
  };
  const next = ns.get(ns.idFromName("g2"));
  const cold = await next.sync(info({ capCell: true }), null);
  assert.equal(cold.forced, "open"); // the operator's override holds from the first answer
  assert.deepEqual(cold.spent, { day: DAY, microusd: 700, reserved: 0 }); // so does the cell's fallback spend today
  const g2 = await ns.instance("g2");
  const pumping = ns.alarm("g2"); // the import, stopped at its first page
  assert.equal(g2.ctx.storage.sql.exec("SELECT COUNT(*) AS n FROM client_keys").one().n, 0);

  // A key not imported yet is found by its digest; a revoked one stays unknown.
  const found = await next.lookupKeys(["a".repeat(64), "c".repeat(64), "f".repeat(64)], info());
  assert.deepEqual(found.keys.map((k) => k.id), ["key_a"]);
  // New traffic of key_a counts here; its counters are the old ones plus the new, once.
  const m = minute();
  const view = await next.sync(info({ keys: ["key_a"], capKeys: true }), {
    usage: [[DAY, "key_a", 1, 7, 3, 1, 0, 0, 0]], windows: [["key_a", m, 1, 10]] });
  const c = view.counts.key_a;
  assert.deepEqual([c[1] + c[3], c[2] + c[4], c[5], c[7]], [6, 60, 60, 700]);
  // A key revoked here before its row arrived stays revoked after.
  assert.notEqual((await next.revokeKey("key_b", info())).revoked_at, null);
  // Whole-table reads add what the import has not brought yet.
  const usage = await next.usage({ from: DAY, to: DAY }, info());
  assert.deepEqual(usage.map((u) => [u.key_id, u.requests, u.prompt_tokens]), [["key_a", 6, 47], ["key_b", 2, 4]]);
  const listed = await next.listKeys(info());
  assert.deepEqual(listed.map((k) => k.id).sort(), ["key_a", "key_b", "key_r"]);
  assert.deepEqual((await next.metrics(info())).keys, { total: 3, active: 1, revoked: 2 });
  // The router's purge asks first, and hears that the import is not done (progress with it).
  const asked = await Promise.race([next.importFrom(info()), new Promise((r) => setTimeout(() => r("waited"), 6000))]);
  assert.equal(asked.imported, false);
  assert.equal(asked.progress.from, "g1");

  open();
  await pumping;
  await drain(ns, "g2");
  assert.notEqual(g2.meta("imported:g1"), null);
  const after = await next.usage({ from: DAY, to: DAY }, info());
  assert.deepEqual(after.map((u) => [u.key_id, u.requests, u.prompt_tokens]), [["key_a", 6, 47], ["key_b", 2, 4]]);
  assert.equal(g2.ctx.storage.sql.exec("SELECT tokens FROM key_month WHERE key_id = 'key_a'").one().tokens, 60);
  assert.notEqual(g2.keyRow("key_b").revoked_at, null);
  assert.deepEqual((await next.metrics(info())).keys, { total: 3, active: 1, revoked: 2 });
  assert.equal(g2.spentOn(DAY).microusd, 700);
  assert.deepEqual((await next.importFrom(info())).imported, true);
});

test("a generation of at most a page comes whole with its head: the first answer has it imported", async () => {
  const ns = objectNamespace(Breaker);
  const old = await ns.instance("g1");
  old.importState("seed", { forced: "closed", months: [{ key_id: "key_a", month: MONTH, tokens: 9 }] });
  const view = await ns.get(ns.idFromName("g2")).sync(info({ keys: ["key_a"] }), null);
  // What g1 had imported (here its seed) counts as imported here too: its rows came with g1's.
  assert.deepEqual([view.imported, view.importing, view.forced, view.counts.key_a[5]], [["g1", "seed"], undefined, "closed", 9]);
  assert.equal(ns.calls.filter((c) => c[1] === "g1" && c[0] !== "get").map((c) => c[0]).join(), "exportHead"); // one round trip
  assert.equal(await ns.alarm("g2"), false); // nothing left for the alarm
});

test("through the router: a key of the draining generation is served during the import, and the purge waits for the end", async () => {
  const BREAKER = objectNamespace(Breaker);
  const env = { BREAKER, CELL_REGION: "us-east", ACTIVE_GENERATION: "g2", ACTIVE_HINT: "enam", DRAINING_GENERATION: "g1",
    DRAINING_HINT: "enam", DEADLINE_MS: "2000", MAX_BODY_BYTES: "10000", FAILURE_THRESHOLD: "2", OPEN_MS: "60000",
    STATE_TTL_MS: "60000", POD_URLS: '["http://pod.test"]', POD_TOKEN: "pt", FALLBACK_URL: "https://fb.test",
    FALLBACK_API_KEY: "fk", PROBE_TOKEN: "prb", FALLBACK_MODEL: "fb-model" };
  BREAKER.env = env;
  const old = await BREAKER.instance("g1");
  const key = newKey();
  old.importState("seed", { keys: [{ id: "key_old", hash: await keyHash(key), prefix: key.slice(0, 10), name: "old", rpm: 0,
    tpm: 0, monthly_tokens: 0, max_parallel: 0, created_at: 1, expires_at: null, revoked_at: null }] });
  old.ctx.storage.sql.exec(`WITH RECURSIVE n(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM n WHERE i < ${EXPORT_ROWS})
    INSERT INTO seg_minute (minute, colo, pod, segment, hist) SELECT 1000 + i, 'IAD', '0', 'total', '~200*2' FROM n`);
  let open;
  const gate = new Promise((resolve) => { open = resolve; });
  const realExport = old.exportAll.bind(old);
  old.exportAll = async (successor, cursor) => {
    await gate;
    return realExport(successor, cursor);
  };
  const pending = [];
  const ctx = { waitUntil: (p) => pending.push(p) };
  const fetch = async (url) => (url.endsWith("/metrics") ? new Response("", { status: 404 })
    : new Response("{}", { headers: { "content-type": "application/json" } }));
  const chat = () => new Request("https://w.test/v1/chat/completions", { method: "POST", headers: { authorization: `Bearer ${key}` },
    body: JSON.stringify({ model: "m", messages: [{ role: "user", content: "hi" }] }) });
  const served = await handle(chat(), env, ctx, { fetch });
  assert.equal(served.status, 200); // its row came ahead of the import
  const pumping = BREAKER.alarm("g2");
  assert.equal((await handle(chat(), env, ctx, { fetch })).status, 200);
  const purge = () => handle(new Request("https://w.test/_colocate/purge", { method: "POST", headers: { authorization: "Bearer prb",
    "content-type": "application/json" }, body: JSON.stringify({ generation: "g1" }) }), env, ctx, { fetch });
  const refused = await purge();
  assert.equal(refused.status, 409);
  const err = (await refused.json()).error;
  assert.equal(err.code, "import_incomplete");
  assert.match(err.message, /refusing to purge g1: g2 has imported 0 of \d+ rows of it/);
  assert.equal((await BREAKER.instance("g1")).keyRow("key_old").id, "key_old"); // nothing was purged
  open();
  await pumping;
  while (await BREAKER.alarm("g2"));
  await Promise.all(pending);
  assert.equal((await purge()).status, 200);
  const usage = (await BREAKER.instance("g2")).sql.exec("SELECT SUM(requests) AS n FROM usage_daily WHERE key_id = 'key_old'").one().n;
  assert.equal(usage, 2); // both requests, counted once, where the state now lives
});
