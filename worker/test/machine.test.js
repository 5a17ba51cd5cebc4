import { test } from "node:test";
import assert from "node:assert/strict";
import { initial, route, record, grantTrial, trialLeaseMs, CLOSED, OPEN, HALF_OPEN } from "../src/machine.js";

const cfg = { failureThreshold: 3, openMs: 1000, deadlineMs: 200 };

test("closed routes to the pod and opens after FAILURE_THRESHOLD consecutive failures", () => {
  let s = initial();
  assert.equal(route(s, 0, cfg), "pod");
  s = record(s, false, 10, cfg);
  s = record(s, false, 20, cfg);
  assert.equal(s.state, CLOSED);
  assert.equal(s.failures, 2);
  s = record(s, false, 30, cfg);
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
