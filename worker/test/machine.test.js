import { test } from "node:test";
import assert from "node:assert/strict";
import { initial, route, record, grantTrial, trialLeaseMs, needsWitness, CLOSED, OPEN, HALF_OPEN, HEALTH } from "../src/machine.js";

const cfg = { failureThreshold: 3, openMs: 1000, deadlineMs: 200 };

const A = { key: "key_a" };
const B = { key: "key_b" };

test("closed routes to the pod and opens after FAILURE_THRESHOLD consecutive failures from two keys", () => {
  let s = initial();
  assert.equal(route(s, 0, cfg), "pod");
  s = record(s, false, 10, cfg, A);
  s = record(s, false, 20, cfg, B);
  assert.equal(s.state, CLOSED);
  assert.equal(s.failures, 2);
  s = record(s, false, 30, cfg, A);
  assert.equal(s.state, OPEN);
  assert.equal(s.opened_at, 30);
  assert.equal(route(s, 500, cfg), "fallback");
});

test("a success between failures resets the count", () => {
  let s = record(record(initial(), false, 1, cfg), false, 2, cfg);
  s = record(s, true, 3, cfg);
  assert.equal(s.failures, 0);
  s = record(record(s, false, 4, cfg), false, 5, cfg);
  assert.equal(s.state, CLOSED);
});

test("open becomes a trial after OPEN_MS; only one trial is granted per lease", () => {
  let s = { ...initial(), state: OPEN, failures: 3, opened_at: 0 };
  assert.equal(route(s, 999, cfg), "fallback");
  assert.equal(route(s, 1000, cfg), "trial");
  const first = grantTrial(s, 1000, cfg);
  assert.equal(first.granted, true);
  assert.equal(first.snap.state, HALF_OPEN);
  const second = grantTrial(first.snap, 1001, cfg);
  assert.equal(second.granted, false);
  assert.equal(route(first.snap, 1001, cfg), "fallback");
  // the holder vanished: once its lease ran out, another request may try
  assert.equal(grantTrial(first.snap, 1000 + trialLeaseMs(cfg), cfg).granted, true);
});

test("a successful trial closes; a failed one reopens with a new open period", () => {
  const half = grantTrial({ ...initial(), state: OPEN, failures: 3, opened_at: 0 }, 1500, cfg).snap;
  const closed = record(half, true, 1600, cfg);
  assert.equal(closed.state, CLOSED);
  assert.equal(closed.failures, 0);
  const reopened = record(half, false, 1600, cfg);
  assert.equal(reopened.state, OPEN);
  assert.equal(reopened.opened_at, 1600);
  assert.equal(route(reopened, 2000, cfg), "fallback");
});

test("force wins over the machine and clearing it resumes", () => {
  let s = { ...initial(), forced: "open" };
  assert.equal(route(s, 2, cfg), "fallback");
  s = { ...initial(), state: OPEN, opened_at: 0, forced: "closed" };
  assert.equal(route(s, 2, cfg), "pod");
  s = { ...s, forced: null };
  assert.equal(route(s, 4, cfg), "fallback");
});

test("one key's failures never open the breaker, however many; a second key or a failed health check does", () => {
  let s = initial();
  for (let i = 1; i <= 50; i++) s = record(s, false, i, cfg, A);
  assert.equal(s.state, CLOSED);
  assert.equal(s.failures, 50);
  assert.deepEqual(s.failure_keys, ["key_a"]);
  assert.equal(needsWitness(s, cfg), true); // the isolate runs a health check
  assert.equal(record(s, false, 51, cfg, B).state, OPEN);
  const checked = record(s, false, 51, cfg, { key: null, health: true });
  assert.equal(checked.state, OPEN);
  assert.deepEqual(checked.failure_keys, ["key_a", HEALTH]);
  // below the threshold a second key is counted but does not open yet, and no check is asked
  const two = record(record(initial(), false, 1, cfg, A), false, 2, cfg, B);
  assert.equal(two.state, CLOSED);
  assert.equal(needsWitness(two, cfg), false);
  assert.equal(record(two, false, 3, cfg, B).state, OPEN);
});

test("a success forgets the streak and its keys; reports without a key are one source", () => {
  let s = record(record(initial(), false, 1, cfg, A), false, 2, cfg, A);
  s = record(s, true, 3, cfg, B);
  assert.equal(s.failures, 0);
  assert.deepEqual(s.failure_keys, []);
  for (let i = 0; i < 5; i++) s = record(s, false, 10 + i, cfg);
  assert.equal(s.state, CLOSED);
  assert.equal(record(s, false, 20, cfg, A).state, OPEN); // an unknown source and a key: two
});

test("a failed trial reopens whoever sent it; health checks alone open a pod nobody can reach", () => {
  const half = { ...initial(), state: HALF_OPEN, failures: 3, opened_at: 0, trial_at: 1000, failure_keys: ["key_a"] };
  assert.equal(record(half, false, 1100, cfg, A).state, OPEN);
  let s = initial();
  const health = { key: null, health: true };
  for (let i = 1; i < cfg.failureThreshold; i++) s = record(s, false, i, cfg, health);
  assert.equal(s.state, CLOSED);
  assert.equal(record(s, false, 9, cfg, health).state, OPEN);
});
