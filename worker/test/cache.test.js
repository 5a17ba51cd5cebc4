import { test } from "node:test";
import assert from "node:assert/strict";
import { KEYS_MAX, ViewCache } from "../src/cache.js";

const view = (at, rev = 1, keys = [{ hash: "h1", id: "key_1" }]) => ({ at, rev, keys, pods: {}, counts: {}, forced: null, imported: [] });

test("unknown and expired entries are stale; young ones fresh", () => {
  const c = new ViewCache();
  assert.equal(c.status("g", 0, 1000), "stale");
  c.put("g", view(1), 0);
  assert.equal(c.status("g", 100, 1000), "fresh");
  assert.equal(c.status("g", 1000, 1000), "stale");
});

test("from half the TTL one background refresh is asked for, not one per request", () => {
  const c = new ViewCache();
  c.put("g", view(1), 0);
  assert.equal(c.status("g", 600, 1000), "refresh");
  c.markRefreshing("g", 600);
  assert.equal(c.status("g", 700, 1000), "fresh");
  c.put("g", view(2), 750);
  assert.equal(c.status("g", 800, 1000), "fresh");
});

test("TTL 0 always waits; generations are separate; an older answer does not replace a newer one", () => {
  const c = new ViewCache();
  c.put("a", view(5, 2, []), 0);
  assert.equal(c.status("a", 0, 0), "stale");
  assert.equal(c.entry("b"), null);
  c.put("a", { ...view(3, 1, []), forced: "open" }, 10);
  assert.equal(c.entry("a").view.at, 5);
  assert.equal(c.entry("a").view.forced, null);
  assert.equal(c.status("a", 505, 1000), "fresh"); // the object answered at 10: confirmed
  assert.equal(c.status("a", 520, 1000), "refresh");
  c.drop("a");
  assert.equal(c.entry("a"), null);
});

const row = (hash, id, rev, over = {}) => ({ hash, id, rev, rpm: 0, tpm: 0, monthly_tokens: 0, max_parallel: 0, expires_at: null,
  revoked: false, ...over });

test("a cold isolate holds no keys, only the revision; keys arrive by look-up", () => {
  const c = new ViewCache();
  assert.equal(c.rev("g"), -1);
  c.put("g", view(1, 40, []), 0);
  assert.equal(c.rev("g"), 40);
  assert.equal(c.entry("g").keys.size, 0);
  assert.equal(c.status("g", 1, 1000), "fresh"); // an empty key list is a usable view
  const found = c.putLookup("g", { rev: 40, keys: [row("h1", "key_1", 7)], counts: { key_1: [9, 1, 2, 3, 4, 5, 6] } }, ["h1", "bad"], 2, 1000);
  assert.equal(found.get("h1").id, "key_1");
  assert.equal(c.entry("g").keys.get("h1").id, "key_1");
  assert.deepEqual(c.count("g", "key_1"), [9, 1, 2, 3, 4, 5, 6]);
  assert.equal(c.isKnownBad("g", "bad", 3), true);
});

test("deltas update or drop held keys, ignore others, and add a digest someone asked for", () => {
  const c = new ViewCache();
  c.put("g", view(1, 10, []), 0);
  c.putLookup("g", { rev: 10, keys: [row("h1", "key_1", 3), row("h2", "key_2", 4)], counts: {} }, ["h1", "h2", "h9"], 1, 5000);
  assert.equal(c.isKnownBad("g", "h9", 2), true);
  const delta = [row("h1", "key_1", 11, { revoked: true }), row("h2", "key_2", 12, { rpm: 5 }), row("h3", "key_3", 13),
    row("h9", "key_9", 14)];
  c.put("g", { ...view(2, 14, delta) }, 2);
  const keys = c.entry("g").keys;
  assert.equal(keys.has("h1"), false); // revoked: dropped
  assert.equal(keys.get("h2").rpm, 5); // changed: updated
  assert.equal(keys.has("h3"), false); // never asked for here: not downloaded
  assert.equal(keys.get("h9").id, "key_9"); // was unknown, now created: held, no longer "bad"
  assert.equal(c.isKnownBad("g", "h9", 3), false);
  assert.equal(c.rev("g"), 14);
  c.put("g", { ...view(3, 14), keys: null }, 3); // nothing changed
  assert.equal(c.entry("g").keys.size, 2);
});

test("a look-up older than the revision held is used once but not kept", () => {
  const c = new ViewCache();
  c.put("g", view(1, 20, []), 0);
  // rev 18 answer: the key may have been revoked at 19 or 20, a change this isolate skipped.
  const found = c.putLookup("g", { rev: 18, keys: [row("h1", "key_1", 5)], counts: {} }, ["h1", "h2"], 1, 1000);
  assert.equal(found.get("h1").id, "key_1");
  assert.equal(c.entry("g").keys.has("h1"), false);
  assert.equal(c.isKnownBad("g", "h2", 2), false);
});

test("a reset (isolate far behind) drops held keys and starts at the current revision", () => {
  const c = new ViewCache();
  c.put("g", view(1, 5, []), 0);
  c.putLookup("g", { rev: 5, keys: [row("h1", "key_1", 2)], counts: {} }, ["h1"], 1, 1000);
  c.put("g", { ...view(2, 9000, []), reset: true }, 2);
  assert.equal(c.entry("g").keys.size, 0);
  assert.equal(c.rev("g"), 9000);
});

test("counters: the keys a sync asked about are replaced (absent = zero), others kept", () => {
  const c = new ViewCache();
  c.put("g", { ...view(1, 1, []), counts: { a: [1, 1, 0, 0, 0, 0, 0], b: [1, 2, 0, 0, 0, 0, 0] } }, 0, ["a", "b"]);
  c.putLookup("g", { rev: 1, keys: [], counts: { z: [1, 9, 0, 0, 0, 0, 0] } }, [], 1, 1000);
  c.put("g", { ...view(2, 1), keys: null, counts: { b: [1, 3, 0, 0, 0, 0, 0] } }, 2, ["a", "b"]);
  assert.equal(c.count("g", "a"), undefined);
  assert.equal(c.count("g", "b")[1], 3);
  assert.equal(c.count("g", "z")[1], 9); // looked up after the sync left: not its business
  c.dropCounts("g", ["z"]);
  assert.equal(c.count("g", "z"), undefined);
});

test("the keys held are bounded", () => {
  const c = new ViewCache();
  c.put("g", view(1, 1, []), 0);
  const rows = Array.from({ length: KEYS_MAX + 10 }, (_, i) => row(`h${i}`, `key_${i}`, 1));
  c.putLookup("g", { rev: 1, keys: rows, counts: {} }, [], 1, 1000);
  assert.equal(c.entry("g").keys.size, KEYS_MAX);
  assert.equal(c.entry("g").keys.has(`h${KEYS_MAX + 9}`), true);
});

test("unknown digests are remembered until the key list changes, and the memory is bounded", () => {
  const c = new ViewCache();
  c.put("g", view(1), 0);
  c.forget("g", "bad", 0, 2000);
  assert.equal(c.isKnownBad("g", "bad", 1999), true);
  assert.equal(c.isKnownBad("g", "bad", 2000), false);
  c.forget("g", "bad", 0, 2000);
  c.put("g", view(2, 2, [{ hash: "bad", id: "key_new", rev: 2 }]), 5); // the "bad" key was just created
  assert.equal(c.isKnownBad("g", "bad", 6), false);
  for (let i = 0; i < 5000; i++) c.forget("g", `d${i}`, 0, 2000);
  assert.ok(c.entry("g").negative.size <= 4096);
});
