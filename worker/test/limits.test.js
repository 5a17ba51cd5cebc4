import { test } from "node:test";
import assert from "node:assert/strict";
import { dayOf, estimate, minuteOf, monthStartDay, refusal, WINDOW_MS } from "../src/limits.js";

const none = () => ({ req: 0, tok: 0 });
const key = (over = {}) => ({ rpm: 0, tpm: 0, monthly_tokens: 0, ...over });

test("the sliding estimate weighs the previous minute by what is left of it", () => {
  const m = 1000;
  const g = [m, 10, 100, 60, 600, 0, 0]; // [minute, req, tok, prev_req, prev_tok, month, inflight elsewhere]
  const t = m * WINDOW_MS + WINDOW_MS / 4; // a quarter into minute m
  assert.deepEqual(estimate(g, none, t), { req: 60 * 0.75 + 10, tok: 600 * 0.75 + 100 });
  // The object's counters are a minute old: its current minute is now the previous one.
  const later = (m + 1) * WINDOW_MS + WINDOW_MS / 2;
  assert.deepEqual(estimate(g, none, later), { req: 5, tok: 50 });
  assert.deepEqual(estimate(g, none, (m + 3) * WINDOW_MS), { req: 0, tok: 0 });
});

test("this isolate's unsynced deltas add to the global counters", () => {
  const m = 5;
  const pending = (minute) => (minute === m ? { req: 3, tok: 30 } : { req: 0, tok: 0 });
  assert.deepEqual(estimate(undefined, pending, m * WINDOW_MS), { req: 3, tok: 30 });
});

test("each limit refuses with its own type and a Retry-After; 0 means no limit", () => {
  const t = 10 * WINDOW_MS + 45_000;
  assert.equal(refusal(key(), { req: 1e9, tok: 1e9 }, 1e12, t), null);
  const rpm = refusal(key({ rpm: 10 }), { req: 10, tok: 0 }, 0, t);
  assert.equal(rpm.type, "requests");
  assert.equal(rpm.retryAfterS, 15);
  assert.equal(refusal(key({ rpm: 10 }), { req: 9.5, tok: 0 }, 0, t), null);
  assert.equal(refusal(key({ tpm: 100 }), { req: 0, tok: 100 }, 0, t).type, "tokens");
  const month = refusal(key({ monthly_tokens: 1000 }), { req: 0, tok: 0 }, 1000, Date.UTC(2026, 11, 31, 23, 59, 0));
  assert.equal(month.type, "insufficient_quota");
  assert.equal(month.retryAfterS, 60);
});

test("max_parallel refuses at the limit of requests in flight, with OpenAI's 429 shape; 0 means none", () => {
  const t = 10 * WINDOW_MS;
  assert.equal(refusal(key(), { req: 0, tok: 0 }, 0, t, 1e6), null);
  assert.equal(refusal(key({ max_parallel: 4 }), { req: 0, tok: 0 }, 0, t, 3), null);
  const no = refusal(key({ max_parallel: 4 }), { req: 0, tok: 0 }, 0, t, 4);
  assert.deepEqual([no.type, no.code, no.retryAfterS], ["requests", "too_many_parallel_requests", 1]);
  assert.match(no.message, /4 at a time/);
});

test("calendar helpers are UTC", () => {
  const t = Date.UTC(2026, 1, 28, 23, 30);
  assert.equal(dayOf(t), "2026-02-28");
  assert.equal(monthStartDay(t), "2026-02-01");
  assert.equal(minuteOf(t + 59_999 - (t % 60_000)), minuteOf(t));
});
