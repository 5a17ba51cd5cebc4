import { test } from "node:test";
import assert from "node:assert/strict";
import { ViewCache } from "../src/cache.js";

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
  c.put("a", view(5, 2), 0);
  assert.equal(c.status("a", 0, 0), "stale");
  assert.equal(c.entry("b"), null);
  c.put("a", view(3, 1, []), 10);
  assert.equal(c.entry("a").view.at, 5);
  assert.equal(c.entry("a").keys.get("h1").id, "key_1");
  assert.equal(c.status("a", 505, 1000), "fresh"); // the object answered at 10: confirmed
  assert.equal(c.status("a", 520, 1000), "refresh");
  c.drop("a");
  assert.equal(c.entry("a"), null);
});

test("keys travel only when their revision changes; the revision held is what a sync sends", () => {
  const c = new ViewCache();
  assert.equal(c.rev("g"), -1);
  c.put("g", view(1, 4), 0);
  assert.equal(c.rev("g"), 4);
  c.put("g", { ...view(2, 4), keys: null }, 1); // unchanged: keep ours
  assert.equal(c.entry("g").keys.get("h1").id, "key_1");
  c.put("g", { ...view(3, 5), keys: null }, 2); // changed but not sent (we asked with an old rev): unknown
  assert.equal(c.entry("g").keys, null);
  assert.equal(c.rev("g"), -1);
  assert.equal(c.status("g", 3, 1000), "stale"); // the next request syncs and asks for the list
  c.drop("g");
  c.put("g", { ...view(4, 5), keys: null }, 4); // an answer that raced a drop (a key created here)
  assert.equal(c.status("g", 5, 1000), "stale");
});

test("unknown digests are remembered until the key list changes, and the memory is bounded", () => {
  const c = new ViewCache();
  c.put("g", view(1), 0);
  c.forget("g", "bad", 0, 2000);
  assert.equal(c.isKnownBad("g", "bad", 1999), true);
  assert.equal(c.isKnownBad("g", "bad", 2000), false);
  c.forget("g", "bad", 0, 2000);
  c.put("g", view(2, 2, [{ hash: "bad", id: "key_new" }]), 5); // the "bad" key was just created
  assert.equal(c.isKnownBad("g", "bad", 6), false);
  for (let i = 0; i < 5000; i++) c.forget("g", `d${i}`, 0, 2000);
  assert.ok(c.entry("g").negative.size <= 4096);
});
