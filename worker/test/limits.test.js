import { test } from "node:test";
import assert from "node:assert/strict";
import { dayOf, estimate, minuteOf, monthStartDay, msUntilBelow, rateHeaders, refusal, WINDOW_MS } from "../src/limits.js";

const none = () => ({ req: 0, tok: 0 });
const key = (over = {}) => ({ rpm: 0, tpm: 0, monthly_tokens: 0, ...over });

test("the sliding estimate weighs the previous minute by what is left of it", () => {
  const m = 1000;
  const g = [m, 10, 100, 60, 600, 0, 0]; // [minute, req, tok, prev_req, prev_tok, month, inflight elsewhere]
  const t = m * WINDOW_MS + WINDOW_MS / 4; // a quarter into minute m
  assert.deepEqual(estimate(g, none, t),
    { req: 60 * 0.75 + 10, tok: 600 * 0.75 + 100, prevReq: 60, curReq: 10, prevTok: 600, curTok: 100 });
  // The object's counters are a minute old: its current minute is now the previous one.
  const later = (m + 1) * WINDOW_MS + WINDOW_MS / 2;
  assert.deepEqual(estimate(g, none, later), { req: 5, tok: 50, prevReq: 10, curReq: 0, prevTok: 100, curTok: 0 });
  assert.deepEqual(estimate(g, none, (m + 3) * WINDOW_MS), { req: 0, tok: 0, prevReq: 0, curReq: 0, prevTok: 0, curTok: 0 });
});

test("this isolate's unsynced deltas add to the global counters", () => {
  const m = 5;
  const pending = (minute) => (minute === m ? { req: 3, tok: 30 } : { req: 0, tok: 0 });
  assert.deepEqual(estimate(undefined, pending, m * WINDOW_MS), { req: 3, tok: 30, prevReq: 0, curReq: 3, prevTok: 0, curTok: 30 });
});

test("each limit refuses with its own type and a Retry-After; 0 means no limit", () => {
  const t = 10 * WINDOW_MS + 45_000;
  assert.equal(refusal(key(), { req: 1e9, tok: 1e9 }, 1e12, t), null);
  const rpm = refusal(key({ rpm: 10 }), { req: 10, tok: 0, prevReq: 0, curReq: 10 }, 0, t);
  assert.equal(rpm.type, "requests");
  assert.equal(rpm.retryAfterS, 16); // 15 s to the minute's end, then the old minute must weigh less than all of it
  assert.equal(refusal(key({ rpm: 10 }), { req: 9.5, tok: 0 }, 0, t), null);
  assert.equal(refusal(key({ tpm: 100 }), { req: 0, tok: 100, prevTok: 0, curTok: 100 }, 0, t).type, "tokens");
  const month = refusal(key({ monthly_tokens: 1000 }), { req: 0, tok: 0 }, 1000, Date.UTC(2026, 11, 31, 23, 59, 0));
  assert.equal(month.type, "insufficient_quota");
  assert.equal(month.retryAfterS, 60);
});

test("Retry-After is when the sliding window admits the next request, not the end of the minute", () => {
  const m = 10;
  const at = (ms) => m * WINDOW_MS + ms;
  // 60 requests last minute, none this one, limit 30: below once the old minute weighs < 30/60.
  assert.equal(msUntilBelow(60, 0, 30, at(0)), 30_001);
  assert.equal(msUntilBelow(60, 0, 30, at(20_000)), 10_001);
  assert.equal(msUntilBelow(60, 0, 30, at(40_000)), 0);
  // The limit used up within this minute: it weighs in until the next minute has worn it down.
  assert.equal(msUntilBelow(0, 30, 30, at(45_000)), 15_001);
  assert.equal(msUntilBelow(0, 60, 30, at(45_000)), 15_000 + 30_000 + 1);
  // The estimate at the moment said is below the limit, and a millisecond earlier it is not.
  for (const [prev, cur, limit, into] of [[60, 0, 30, 5_000], [40, 20, 30, 1_000], [0, 45, 30, 50_000], [17, 13, 25, 3_333]]) {
    const t = at(into);
    const wait = msUntilBelow(prev, cur, limit, t);
    const g = [m, cur, 0, prev, 0, 0, 0];
    assert.ok(estimate(g, none, t + wait).req < limit, `${prev},${cur},${limit}: below after ${wait} ms`);
    assert.ok(estimate(g, none, t + wait - 2).req >= limit, `${prev},${cur},${limit}: not below before`);
  }
  const no = refusal(key({ rpm: 30 }), estimate([m, 0, 0, 60, 0, 0, 0], none, at(20_000)), 0, at(20_000));
  assert.equal(no.retryAfterS, 11); // not 40, the time to the end of the minute
});

test("OpenAI's x-ratelimit headers: the key's limits, what is left with this request, when the window admits the next", () => {
  const m = 10;
  const t = m * WINDOW_MS + 45_000;
  const est = estimate([m, 4, 500, 8, 800, 0, 0], none, t); // 8 x 0.25 + 4 = 6 requests, 800 x 0.25 + 500 = 700 tokens
  assert.deepEqual(rateHeaders(key({ rpm: 10, tpm: 1000 }), est, t, true), [
    ["x-ratelimit-limit-requests", "10"],
    ["x-ratelimit-remaining-requests", "3"],
    ["x-ratelimit-reset-requests", "0s"], // room is left: the next is admitted now
    ["x-ratelimit-limit-tokens", "1000"],
    ["x-ratelimit-remaining-tokens", "300"],
    ["x-ratelimit-reset-tokens", "0s"],
  ]);
  assert.deepEqual(rateHeaders(key({ tpm: 1000 }), est, t, true, 250)[1], ["x-ratelimit-remaining-tokens", "50"]); // reserved counts as used
  assert.deepEqual(rateHeaders(key(), est, t, true), []); // no limit, no headers
});

test("over rpm, Retry-After and x-ratelimit-reset-requests say the same wait, never past a minute", () => {
  const m = 10;
  for (const into of [0, 1, 17_000, 43_500, 59_999]) {
    const t = m * WINDOW_MS + into;
    for (const [prev, cur] of [[0, 2], [2, 0], [1, 1], [2, 2], [5, 3], [0, 7]]) {
      const est = estimate([m, cur, 0, prev, 0, 0, 0], none, t);
      const k = key({ rpm: 2 });
      const no = refusal(k, est, 0, t);
      if (no === null) continue;
      const reset = Object.fromEntries(rateHeaders(k, est, t, false))["x-ratelimit-reset-requests"];
      const [, mm, ss] = /^(?:(\d+)m)?(\d+)s$/.exec(reset);
      const resetS = Number(mm ?? 0) * 60 + Number(ss);
      assert.ok(Math.abs(resetS - no.retryAfterS) <= 1, `${prev}/${cur} at ${into}: ${reset} vs ${no.retryAfterS}`);
      assert.ok(resetS <= 60 && no.retryAfterS <= 60, `${prev}/${cur} at ${into}: ${reset}, ${no.retryAfterS}`);
    }
  }
});

test("requests in flight hold what they reserved: the next is refused for 1 s while they would cross tpm or the month", () => {
  const t = 10 * WINDOW_MS;
  const zero = { req: 0, tok: 0, prevReq: 0, curReq: 0, prevTok: 0, curTok: 0 };
  assert.equal(refusal(key({ monthly_tokens: 50 }), zero, 0, t, 0, 49), null);
  const no = refusal(key({ monthly_tokens: 50 }), zero, 0, t, 0, 50);
  assert.deepEqual([no.type, no.code, no.retryAfterS], ["tokens", "tokens_reserved", 1]);
  assert.match(no.message, /50 tokens this month \(50 tokens reserved\)/);
  assert.equal(refusal(key({ tpm: 100 }), { ...zero, tok: 60 }, 0, t, 0, 40).code, "tokens_reserved");
  assert.equal(refusal(key({ tpm: 100 }), { ...zero, tok: 60 }, 0, t, 0, 39), null);
  assert.equal(refusal(key(), zero, 0, t, 0, 1e9), null); // no token limit: nothing is held
  // already over the month's budget: the month's end, not 1 s
  assert.equal(refusal(key({ monthly_tokens: 50 }), zero, 50, t, 0, 10).code, "insufficient_quota");
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
