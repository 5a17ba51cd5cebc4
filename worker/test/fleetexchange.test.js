import { test } from "node:test";
import assert from "node:assert/strict";
import { addPeer, aligned, badRows, goodRows, monthOf, rowProblem, sumRows } from "../src/fleetexchange.js";
import { WINDOW_MS, estimate, minuteOf, refusal } from "../src/limits.js";
import { COUNTER } from "../src/payloads.js";

const T = Date.UTC(2026, 11, 4, 12, 0, 30); // 30 s into a minute
const M = minuteOf(T);
const row = (cell, minute, req, tok, prevReq = 0, prevTok = 0, month = "2026-12", monthTokens = 0) =>
  ["key_0123456789ab", minute, req, tok, prevReq, prevTok, month, monthTokens];

test("a row from an older minute moves into the previous bucket, then out", () => {
  assert.deepEqual(aligned(row("a", M, 5, 50, 2, 20), M), [5, 50, 2, 20]);
  assert.deepEqual(aligned(row("a", M - 1, 5, 50, 2, 20), M), [0, 0, 5, 50]);
  assert.deepEqual(aligned(row("a", M - 2, 5, 50, 2, 20), M), [0, 0, 0, 0]);
});

test("the others' sum aligns each cell's row to now and keeps only this month's tokens", () => {
  const rows = [row("a", M, 3, 30, 1, 10, "2026-12", 100), row("b", M - 1, 4, 40, 9, 90, "2026-12", 7),
    row("c", M, 1, 1, 0, 0, "2026-11", 5000)];
  assert.deepEqual(sumRows("key_0123456789ab", rows, T), ["key_0123456789ab", M, 4, 31, 5, 50, "2026-12", 107]);
  assert.deepEqual(sumRows("key_0123456789ab", [], T), ["key_0123456789ab", M, 0, 0, 0, 0, "2026-12", 0]);
  assert.equal(monthOf(T), "2026-12");
});

test("own + peers is what the limits see: a key used up elsewhere is refused here", () => {
  const key = { rpm: 10, tpm: 0, monthly_tokens: 100, max_parallel: 0 };
  const own = [M, 4, 0, 0, 0, 60, 0];
  const none = () => ({ req: 0, tok: 0 });
  assert.equal(refusal(key, estimate(own, none, T), own[COUNTER.month_tokens], T), null);
  // The other cells admitted 6 this minute and 40 tokens this month: together 10 and 100.
  const c = addPeer([...own], row("x", M, 6, 0, 0, 0, "2026-12", 40), T);
  assert.equal(c[COUNTER.req], 10);
  assert.equal(refusal(key, estimate(c, none, T), c[COUNTER.month_tokens], T).code, "rate_limit_exceeded");
  const tokensOnly = addPeer([M, 0, 0, 0, 0, 60, 0], row("x", M - 5, 0, 0, 0, 0, "2026-12", 40), T);
  assert.equal(refusal(key, estimate(tokensOnly, none, T), tokensOnly[COUNTER.month_tokens], T).code, "insufficient_quota");
  // A minute later the peers' requests weigh as the previous bucket does.
  const later = addPeer([M + 1, 0, 0, 0, 0, 0, 0], row("x", M, 6, 0), T + WINDOW_MS);
  assert.equal(later[COUNTER.prev_req], 6);
});

test("pushed rows are checked field by field", () => {
  assert.equal(badRows([row("a", M, 1, 2, 3, 4, "2026-12", 5)]), null);
  assert.match(badRows({}), /field "rows" must be an array/);
  assert.match(rowProblem([1], 0), /field "rows\[0\]" must be \[key_id/);
  assert.match(rowProblem(["key_x", M, 0, 0, 0, 0, "2026-12", 0], 1), /field "rows\[1\]"\[0\] must be a key id/);
  assert.match(rowProblem(row("a", M, -1, 2), 0), /field "rows\[0\]"\[2\] must be a whole number >= 0 \(got -1\)/);
  assert.match(rowProblem(row("a", M, 1, 2, 0, 0, "Dec"), 0), /\[6\] must be a month YYYY-MM/);
  // One row past 2^53 is dropped, not the batch.
  const { good, dropped } = goodRows([row("a", M, 1, 2), row("b", M, 0, 0, 0, 0, "2026-12", 2 ** 53), [1]]);
  assert.deepEqual(good, [row("a", M, 1, 2)]);
  assert.equal(dropped.length, 2);
  assert.match(dropped[0], /field "rows\[1\]"\[7\] must be a whole number/);
  const sum = sumRows(row("a", M)[0], [row("a", M, 0, 0, 0, 0, monthOf(M * 60000), Number.MAX_SAFE_INTEGER),
    row("a", M, 0, 0, 0, 0, monthOf(M * 60000), 5)], M * 60000);
  assert.equal(sum[7], Number.MAX_SAFE_INTEGER);
  assert.match(badRows(Array.from({ length: 5001 }, () => row("a", M, 0, 0))), /at most 5000 rows/);
});
