import { test } from "node:test";
import assert from "node:assert/strict";
import { candidates, finished, inflightOf, leastBusy, started } from "../src/pods.js";

const cfg = { openMs: 1000, deadlineMs: 100 };
const urls = ["http://a", "http://b", "http://c"];
const view = (pods = {}, forced = null) => ({ pods, forced });

test("healthy pods are candidates; an open pod only once its open period is over, as a trial", () => {
  const v = view({ "http://b": { state: "open", failures: 3, opened_at: 0, trial_at: null } });
  assert.deepEqual(candidates(urls, v, 500, cfg), { pods: [0, 2], trials: [] });
  assert.deepEqual(candidates(urls, v, 1500, cfg), { pods: [0, 2], trials: [1] });
  assert.deepEqual(candidates(urls, v, 500, cfg, new Set([0])), { pods: [2], trials: [] });
  assert.deepEqual(candidates(urls, view({}, "open"), 0, cfg), { pods: [], trials: [] });
  assert.deepEqual(candidates(urls, view(v.pods, "closed"), 0, cfg).pods, [0, 1, 2]);
});

test("the least busy pod wins; ties are broken at random", () => {
  started("http://a");
  started("http://a");
  started("http://b");
  assert.equal(leastBusy(urls, [0, 1, 2]), 2);
  assert.equal(leastBusy(urls, [0, 1]), 1);
  const picks = new Set();
  for (let i = 0; i < 200; i++) picks.add(leastBusy(urls, [1, 2].map((x) => x)) === 2 ? "c" : "b");
  assert.deepEqual([...picks], ["c"]);
  finished("http://a");
  finished("http://a");
  finished("http://b");
  assert.equal(inflightOf("http://a"), 0);
  const ties = new Set();
  for (let i = 0; i < 200; i++) ties.add(leastBusy(urls, [0, 1, 2]));
  assert.deepEqual([...ties].sort(), [0, 1, 2]);
  assert.equal(leastBusy(urls, []), -1);
});
