import { test } from "node:test";
import assert from "node:assert/strict";
import { SnapshotCache } from "../src/cache.js";

const snap = (updated_at) => ({ state: "closed", failures: 0, updated_at });

test("unknown and expired entries are stale; young ones fresh", () => {
  const c = new SnapshotCache();
  assert.equal(c.status("g", 0, 1000), "stale");
  c.put("g", snap(1), 0);
  assert.equal(c.status("g", 100, 1000), "fresh");
  assert.equal(c.status("g", 1000, 1000), "stale");
});

test("from half the TTL one background refresh is asked for, not one per request", () => {
  const c = new SnapshotCache();
  c.put("g", snap(1), 0);
  assert.equal(c.status("g", 600, 1000), "refresh");
  c.markRefreshing("g", 600);
  assert.equal(c.status("g", 700, 1000), "fresh");
  c.put("g", snap(2), 750);
  assert.equal(c.status("g", 800, 1000), "fresh");
});

test("TTL 0 always waits; generations are separate; an older answer does not replace a newer one", () => {
  const c = new SnapshotCache();
  c.put("a", snap(5), 0);
  assert.equal(c.status("a", 0, 0), "stale");
  assert.equal(c.get("b"), null);
  c.put("a", snap(3), 10);
  assert.equal(c.get("a").updated_at, 5);
  assert.equal(c.status("a", 505, 1000), "fresh"); // the object answered at 10: confirmed
  assert.equal(c.status("a", 520, 1000), "refresh");
  c.drop("a");
  assert.equal(c.get("a"), null);
});
