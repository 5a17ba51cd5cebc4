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
