// The generation object's in-memory stand-in (support/objects.js) keeps the storage contract
// generation.js relies on, so the router tests run the object's own code and SQL.
import { test } from "node:test";
import assert from "node:assert/strict";
import { objectNamespace } from "./support/objects.js";
import { keyHash, newKey } from "../src/keys.js";

const { Breaker } = await import("../src/generation.js");

test("a transaction that throws leaves nothing behind; exec counts what it wrote", async () => {
  const ns = objectNamespace(Breaker);
  const object = await ns.instance("g");
  const { sql, transactionSync } = object.ctx.storage;
  assert.equal(sql.exec("INSERT INTO meta (k, v) VALUES ('a', '1')").rowsWritten, 1);
  assert.throws(() => transactionSync(() => { sql.exec("INSERT INTO meta (k, v) VALUES ('b', '2')"); throw new Error("no"); }), /no/);
  assert.deepEqual(sql.exec("SELECT k FROM meta WHERE k IN ('a', 'b')").toArray(), [{ k: "a" }]);
  assert.throws(() => sql.exec("SELECT k FROM meta WHERE k IN ('a', 'b', 'schema')").one(), /exactly one/);
});

test("through the stub, a key the object made is found by its digest, and answers are copies", async () => {
  const ns = objectNamespace(Breaker);
  const key = newKey();
  const hash = await keyHash(key);
  const stub = ns.get(ns.idFromName("g"), { locationHint: "enam" });
  await stub.createKey({ id: "key_1", hash, prefix: key.slice(0, 12), name: "t", rpm: 0, tpm: 0, monthly_tokens: 0,
    max_parallel: 0, created_at: 1, expires_at: null }, { generation: "g" });
  const found = await stub.lookupKeys([hash], { generation: "g", keys: [] });
  assert.deepEqual(found.keys.map((k) => k.id), ["key_1"]);
  found.keys[0].revoked_at = 5; // the caller's copy, not the object's row
  assert.equal((await stub.listKeys({ generation: "g" }))[0].revoked_at, null);
  assert.deepEqual(ns.calls.map((c) => c.slice(0, 2)), [["get", "g"], ["createKey", "g"], ["lookupKeys", "g"], ["listKeys", "g"]]);
  await assert.rejects(stub.noSuchMethod(), /does not implement/);
});

test("a sync's histogram rows are stored in four statements, as adding them one by one stores them", async () => {
  const ns = objectNamespace(Breaker);
  const [bulk, single] = [await ns.instance("hist-bulk"), await ns.instance("hist-single")];
  const now = Date.UTC(2026, 11, 7, 12, 0);
  const m = Math.floor(now / 60000);
  const before = [[m, "IAD", "0", "ttft", "~40*2"], [m - 1, "IAD", "0", "ttft", "~41"]]; // stored rows to merge into
  const rows = [
    [m, "IAD", "0", "ttft", "~40,3*2"], // onto a stored row
    [m, "IAD", "0", "ttft", "~44"], // the same key twice in one batch: both count
    [m - 1, "IAD", "0", "ttft", "~50"], // another minute, the same total
    [m, "NRT", "fallback", "total", "~7"],
    [m, "IAD", "0", "total", "~3,x"], // malformed: dropped, and not in the total
    [m, "IAD", "0", "upstream", ""], // empty: nothing to add
    [m, "IAD", "0", "nonsense", "~1"], // not a segment
    "not a row",
  ];
  for (const o of [bulk, single]) for (const r of before) { o.addSeg("seg_minute", "minute", r); o.addTotal(r[1], r[2], r[3], r[4]); }
  const statements = [];
  const exec = bulk.sql.exec.bind(bulk.sql);
  bulk.sql.exec = (q, ...a) => (statements.push(q), exec(q, ...a));
  bulk.addHist(rows, now);
  bulk.sql.exec = exec;
  for (const r of rows.slice(0, 6)) if (single.addSeg("seg_minute", "minute", r)) single.addTotal(r[1], r[2], r[3], r[4]);
  const table = (o, t) => o.sql.exec(`SELECT * FROM ${t} ORDER BY colo, pod, segment${t === "seg_minute" ? ", minute" : ""}`).toArray();
  for (const t of ["seg_minute", "seg_total"]) assert.deepEqual(table(bulk, t), table(single, t), t);
  // buckets 40: 2 + 1, 41: 1, 43: 2, 44: 1, 50: 1 (both minutes, and the key twice in the batch)
  assert.equal(table(bulk, "seg_total").find((r) => r.pod === "0" && r.segment === "ttft").hist, "~40*3,1,2*2,1,6");
  assert.equal(statements.filter((q) => /seg_(minute|total)/.test(q) && !/MIN\(minute\)|DELETE/.test(q)).length, 4);
});
