import { test } from "node:test";
import assert from "node:assert/strict";
import {
  aligned, badLeases, badRows, defaultShare, fairShares, floorShare, goodRows, grant, monthOf, rowProblem, slackOf, sumRows, upgradeRow, weights,
} from "../src/fleetexchange.js";
import { WINDOW_MS, estimate, leaseRefusal, minuteOf, refusal, underFleetLimit } from "../src/limits.js";
import { COUNTER, EXCHANGE, LEASE } from "../src/payloads.js";

const T = Date.UTC(2026, 11, 4, 12, 0, 30); // 30 s into a minute
const M = minuteOf(T);
const row = (cell, minute, req, tok, prevReq = 0, prevTok = 0, month = "2026-12", monthTokens = 0, day = "2026-12-04", fb = 0) =>
  ["key_0123456789ab", minute, req, tok, prevReq, prevTok, month, monthTokens, day, fb];

test("a row from an older minute moves into the previous bucket, then out", () => {
  assert.deepEqual(aligned(row("a", M, 5, 50, 2, 20), M), [5, 50, 2, 20]);
  assert.deepEqual(aligned(row("a", M - 1, 5, 50, 2, 20), M), [0, 0, 5, 50]);
  assert.deepEqual(aligned(row("a", M - 2, 5, 50, 2, 20), M), [0, 0, 0, 0]);
});

test("the others' sum aligns each cell's row to now and keeps only this month's tokens", () => {
  const rows = [row("a", M, 3, 30, 1, 10, "2026-12", 100, "2026-12-04", 7), row("b", M - 1, 4, 40, 9, 90, "2026-12", 7, "2026-12-04", 5),
    row("c", M, 1, 1, 0, 0, "2026-11", 5000, "2026-12-03", 900)];
  assert.deepEqual(sumRows("key_0123456789ab", rows, T), ["key_0123456789ab", M, 4, 31, 5, 50, "2026-12", 107, "2026-12-04", 12]);
  assert.deepEqual(sumRows("key_0123456789ab", [], T), ["key_0123456789ab", M, 0, 0, 0, 0, "2026-12", 0, "2026-12-04", 0]);
  assert.equal(monthOf(T), "2026-12");
});

test("a cell's lease bounds what it admits of a key: whole requests, then tokens and the month", () => {
  const key = { rpm: 30, tpm: 1000, monthly_tokens: 5000, max_parallel: 0 };
  const none = () => ({ req: 0, tok: 0 });
  const lease = { req: 4, tok: 300, month_tokens: 2000 };
  const row = (req, tok, prevReq = 0) => {
    const c = COUNTER.zero(M);
    c[COUNTER.req] = req;
    c[COUNTER.tok] = tok;
    c[COUNTER.prev_req] = prevReq;
    return c;
  };
  const own = (req, tok = 0) => estimate(row(req, tok), none, T);
  assert.equal(leaseRefusal(key, lease, own(3), 0), null);
  const r = leaseRefusal(key, lease, own(4), 0);
  assert.equal(r.code, "rate_limit_exceeded");
  assert.equal(r.retryAfterS, 1);
  assert.match(r.message, /share of 30 requests per minute/);
  // A fractional estimate (the previous minute's weight) must leave room for a whole request.
  const sliding = estimate(row(3, 0, 2), none, T); // 3 + 2 x 0.5 = 4
  assert.equal(sliding.req, 4);
  assert.equal(leaseRefusal(key, { ...lease, req: 4.5 }, sliding, 0).type, "requests");
  assert.equal(leaseRefusal(key, lease, own(0, 300), 0).type, "tokens");
  // Two requests cost 140 tokens each here: a third would not fit in 300.
  assert.equal(leaseRefusal(key, lease, own(2, 280), 0).type, "tokens");
  assert.equal(leaseRefusal(key, lease, own(2, 150), 0), null);
  assert.equal(leaseRefusal(key, lease, own(2, 150), 1950).code, "insufficient_quota");
  assert.equal(leaseRefusal(key, lease, own(0), 2000).code, "insufficient_quota");
  assert.equal(leaseRefusal(key, { req: null, tok: null, month_tokens: null }, own(100, 1e6), 1e9), null);
});

test("a refusal by lease tells whether the key is under its limit with the peers' counts added", () => {
  const key = { rpm: 30, tpm: 1000, monthly_tokens: 5000, max_parallel: 1 };
  const none = () => ({ req: 0, tok: 0 });
  const own = (req, tok = 0) => estimate([M, req, tok, 0, 0, 0, 0, 0], none, T);
  const peers = (req, tok = 0, prevReq = 0, month = 0, minute = M) => [minute, req, tok, prevReq, 0, month, 0, 0];
  const lease = (p) => ({ req: 10, tok: 300, month_tokens: 2000, peers: p });
  assert.equal(leaseRefusal(key, lease(null), own(10), 0).byLease, true);
  assert.equal(refusal(key, own(10), 0, T), null); // the key's own limit alone would admit it
  // No peer row: the other cells counted nothing.
  assert.equal(underFleetLimit(key, lease(null), own(10), 0, T), true);
  assert.equal(underFleetLimit(key, lease(peers(19)), own(10), 0, T), true); // 29 of 30
  assert.equal(underFleetLimit(key, lease(peers(20)), own(10), 0, T), false); // 30 of 30
  // The peers' previous minute weighs as the sliding window says (half of it, 30 s in) ...
  assert.equal(underFleetLimit(key, lease(peers(0, 0, 39)), own(10), 0, T), true); // 10 + 19.5
  assert.equal(underFleetLimit(key, lease(peers(0, 0, 40)), own(10), 0, T), false); // 10 + 20
  // ... and a row two minutes old counts nothing.
  assert.equal(underFleetLimit(key, lease(peers(50, 0, 50, 0, M - 2)), own(10), 0, T), true);
  // Tokens and the month add up the same way; max_parallel is each cell's own, not summed.
  assert.equal(underFleetLimit(key, lease(peers(0, 700)), own(1, 300), 0, T), false);
  assert.equal(underFleetLimit(key, lease(peers(0, 0, 0, 4000)), own(1), 1000, T), false);
  assert.equal(underFleetLimit(key, lease(peers(0, 0, 0, 3999)), own(1), 1000, T), true);
});

test("the default share splits the cap (limit + max(10 %, 1)) evenly", () => {
  assert.equal(slackOf(10), 1);
  assert.equal(slackOf(5), 1);
  assert.equal(slackOf(600), 60);
  assert.equal(defaultShare(30, 2), 16);
  assert.equal(defaultShare(10, 3), 3);
  assert.equal(defaultShare(600, 3), 220);
});

const sum = (a) => a.reduce((x, y) => x + y, 0);

test("fair shares: what the cells may admit never passes the cap; idle cells keep a share", () => {
  assert.deepEqual(fairShares(30, [30, 0]), [30, 3]);
  assert.deepEqual(fairShares(10, [9, 0, 0]), [9, 1, 1]);
  assert.deepEqual(fairShares(10, [10, 0, 0]), [10, 1, 0]);
  assert.deepEqual(fairShares(600, [600, 0, 0]), [600, 30, 30]);
  // The unused part of the cap is split evenly: an idle cell holds a share a key can move to.
  assert.deepEqual(fairShares(30, [12, 0]), [23, 10]);
  assert.deepEqual(fairShares(30, [16, 16]), [17, 16]);
  for (const limit of [1, 2, 5, 10, 30, 600, 100_000]) {
    for (const used of [[0, 0], [0, 0, 0], [limit, 0, 0], [limit / 2, limit / 3, 0], [0.7 * limit, 0.3 * limit], [limit, limit, 0]]) {
      const shares = fairShares(limit, used);
      const may = sum(shares.map((x, j) => Math.max(x, used[j])));
      assert.ok(may <= Math.max(limit + slackOf(limit), sum(used)) + 1e-9, `${limit} ${used} -> ${shares}`);
      assert.ok(shares.every((x) => Number.isInteger(x) && x >= 0 && x <= limit), `${limit} ${used} -> ${shares}`);
    }
  }
});

test("fair shares: a key alone in one cell settles at >= 90 % of its limit there", () => {
  for (const n of [2, 3]) {
    for (const limit of [10, 30, 600, 1000, 5000]) {
      let shares = Array(n).fill(defaultShare(limit, n));
      for (let round = 0; round < 50; round++) shares = fairShares(limit, [shares[0], ...Array(n - 1).fill(0)]);
      assert.ok(shares[0] >= 0.9 * limit, `${n} cells, ${limit}: ${shares}`);
      assert.ok(shares.slice(1).every((x) => x >= 1), `${n} cells, ${limit}: ${shares}`);
    }
  }
});

test("floor share: what an isolate that forgot a key's lease admits, which the ledger counts for every cell", () => {
  assert.deepEqual([[30, 3], [10, 3], [10, 2], [600, 3], [1, 3], [3, 2]].map(([l, n]) => floorShare(l, n)), [1, 1, 1, 30, 0, 1]);
  for (const limit of [10, 30, 600, 3_000_000]) {
    for (const n of [2, 3, 5]) {
      const f = floorShare(limit, n);
      assert.ok(f <= defaultShare(limit, n), `${limit} ${n}`);
      // A key alone in one cell, the others held at their floor: still >= 90 % of its limit there
      // (a small limit over many cells: no less than the unit each idle cell gets anyway, fairShares).
      assert.ok(limit + slackOf(limit) - (n - 1) * f >= Math.min(0.9 * limit, limit + slackOf(limit) - (n - 1)), `${limit} ${n}`);
    }
  }
  // The grant never passes the cap with every cell held at least at its floor (fleetledger.js apportion).
  const L = 30;
  const f = floorShare(L, 3);
  const g = grant(L, [25, 0, 0], [25, f, f].map((h) => Math.max(h, f)), [25, 4, 4], [31, 1, 1]);
  assert.ok(Math.max(25, g.held[0]) + Math.max(f, g.held[1]) + Math.max(f, g.held[2]) <= L + slackOf(L), String(g.held));
});

test("weights: a cell that used the key lately weighs as four idle ones", () => {
  assert.deepEqual(weights([undefined, undefined]), [1, 1]);
  assert.deepEqual(weights([{ at: 1 }, undefined, undefined]), [4, 1, 1]);
  assert.deepEqual(weights([{ at: 1 }, { at: 2 }]), [4, 4]);
});

test("grant: an increase only within what the other cells may still admit; a decrease at once, down to the limit", () => {
  // B's lease is to fall from 16 to 11, but B may still use 16 until the ledger is sure it
  // stopped, so A may grow by 1 only: B falls to 13, where A 17 + B 13 still admit 30.
  const g = grant(30, [10, 0], [16, 16], [16, 16], [22, 11]);
  assert.deepEqual(g.lease, [17, 13]);
  assert.deepEqual(g.held, [17, 16]);
  assert.ok(Math.max(10, g.held[0]) + Math.max(0, g.held[1]) <= 33);
  // Once B's 16 is no longer held, A grows by what B gave; once B's 13 has landed, both reach their targets.
  assert.deepEqual(grant(30, [10, 0], [17, 16], [17, 13], [22, 11]).lease, [17, 13]);
  assert.deepEqual(grant(30, [10, 0], [17, 13], [17, 13], [22, 11]).lease, [20, 11]);
  assert.deepEqual(grant(30, [10, 0], [20, 11], [20, 11], [22, 11]).lease, [22, 11]);
  // Used counts too: a cell over its lease (it refuses) still holds what it used.
  assert.deepEqual(grant(30, [20, 12], [20, 12], [20, 12], [25, 8]).lease, [21, 8]);
  // Nothing is granted past the cap even when targets ask for it; nothing is taken below current but by a decrease.
  const tight = grant(10, [0, 0, 0], [10, 10, 10], [3, 3, 3], [9, 1, 1]);
  assert.deepEqual(tight.lease, [3, 3, 3]);
  // A cut that leaves the cells the limit is made at once.
  assert.deepEqual(grant(30, [0, 0], [30, 3], [30, 3], [16, 17]).lease, [27, 3]);
});

test("grant, any state: never past the cap, never below the limit, and a move's leases reach their targets", () => {
  let seed = 7;
  const rand = () => ((seed = Math.imul(seed, 48271) % 2147483647) & 0x7fffffff) / 2147483647;
  for (let i = 0; i < 3000; i++) {
    const limit = [1, 3, 10, 30, 600][i % 5];
    const cap = limit + slackOf(limit);
    const n = 2 + (i % 3);
    // A state the ledger can be in: what the cells may admit, max(used, held), within the cap;
    // used is a sliding estimate (fractional), at times past a cell's lease.
    const used = Array.from({ length: n }, () => rand() * cap / n * 1.2);
    const current = used.map(() => Math.floor(rand() * (cap / n + 2)));
    const held = current.map((c) => c + Math.floor(rand() * 2));
    if (sum(held.map((h, j) => Math.max(used[j], h))) > cap) continue;
    const targets = fairShares(limit, used, used.map(() => 1 + 3 * Math.floor(rand() * 2)));
    const g = grant(limit, used, held, current, targets);
    const state = `${limit} used ${used} held ${held} current ${current} targets ${targets} -> ${g.lease}`;
    assert.ok(sum(g.held.map((h, j) => Math.max(used[j], h, g.lease[j]))) <= cap, state);
    assert.ok(g.lease.every((x) => Number.isInteger(x) && x >= 0), state);
    const before = sum(current.map((c, j) => Math.max(used[j], c)));
    assert.ok(sum(g.lease.map((x, j) => Math.max(used[j], x))) >= Math.min(limit, before) - 1e-9, state);
    // Each cut and each increase moves toward its target, never past it.
    g.lease.forEach((x, j) => assert.ok(x === current[j] || (x - current[j]) * (targets[j] - current[j]) > 0, state));
  }
  // A key that leaves cell A for B: each round's leases land before the next, and they reach the targets.
  for (const limit of [3, 10, 30, 600]) {
    let current = [limit, slackOf(limit)];
    let rounds = 0;
    for (; rounds < 100; rounds++) {
      const next = grant(limit, [0, 0], current, current, [slackOf(limit), limit]).lease;
      if (next.every((x, j) => x === current[j])) break;
      current = next;
    }
    assert.deepEqual(current, [slackOf(limit), limit], `${limit}`);
    assert.ok(rounds <= 2 * Math.ceil(limit / slackOf(limit)), `${limit}: ${rounds} landings`);
  }
});

/**
 * A key with rpm 30 sent 1 request a second to cell A, then to cell B, through a front door
 * that tries the other cell when one refuses by its lease; the ledger's round every second
 * (fairShares, weights, grant) sees the cells' counts `lagS` late, a lease reaches its cell
 * half a second after its round and lands 2 s after it (stateTtlMs 1000 plus the margin).
 * Returns the requests refused while the key was under its limit.
 */
function refusedUnderLimit(moveAtS, lagS) {
  const L = 30;
  let sent = [defaultShare(L, 2), defaultShare(L, 2)];
  let held = [...sent];
  const until = [0, 0];
  const applied = [...sent];
  const arriving = [];
  const count = [0, 0];
  const history = [];
  const lastMoved = [-Infinity, -Infinity];
  let seenCount = [0, 0];
  let admitted = 0;
  let refused = 0;
  for (let t = 0; t < 50; t = Math.round((t + 0.1) * 10) / 10) {
    for (const a of arriving.filter((x) => x.at <= t)) applied[a.cell] = a.lease;
    arriving.splice(0, arriving.length, ...arriving.filter((x) => x.at > t));
    if (Math.round(t * 10) % 10 === 3 && admitted < L) {
      const near = t < moveAtS ? 0 : 1;
      const cell = [near, 1 - near].find((c) => count[c] + 1 <= applied[c]);
      if (cell === undefined) refused += 1;
      else {
        count[cell] += 1;
        admitted += 1;
      }
    }
    history.push([t, [...count]]);
    if (Math.round(t * 10) % 10 === 0) {
      const seen = (history.filter(([at]) => at <= t - lagS).at(-1) ?? [0, [0, 0]])[1];
      for (let c = 0; c < 2; c++) if (seen[c] !== seenCount[c]) lastMoved[c] = t;
      seenCount = seen;
      const kept = [0, 1].map((c) => (until[c] <= t ? sent[c] : Math.max(held[c], sent[c])));
      const w = weights(lastMoved.map((at) => (t - at <= 2 ? { at } : undefined)));
      const g = grant(L, seen, kept, sent, fairShares(L, seen, w));
      for (let c = 0; c < 2; c++) {
        if (g.lease[c] === sent[c]) {
          if (until[c] <= t) held[c] = sent[c];
          continue;
        }
        held[c] = Math.max(kept[c], g.lease[c]);
        sent[c] = g.lease[c];
        until[c] = t + 2;
        arriving.push({ cell: c, lease: g.lease[c], at: t + 0.5 });
      }
    }
  }
  assert.equal(admitted, L);
  return refused;
}

test("a key that moves cell is never refused under its limit while the ledger hands its lease over", () => {
  // Cut at once to its target, A's lease left a move after 13 or 15 s (counts 2 s late) or
  // after 25 s (0.5 s late) refused once under the limit: A had used its new lease, and B's
  // growth waited for A's old one to land.
  for (const lagS of [0.5, 1, 1.5, 2, 2.5]) {
    for (const moveAtS of [5, 10, 12, 13, 15, 20, 25]) assert.equal(refusedUnderLimit(moveAtS, lagS), 0, `${moveAtS} s, lag ${lagS} s`);
  }
});

test("pushed rows are checked field by field", () => {
  assert.equal(badRows([row("a", M, 1, 2, 3, 4, "2026-12", 5)]), null);
  assert.match(badRows({}), /field "rows" must be an array/);
  assert.match(rowProblem([1], 0), /field "rows\[0\]" must be \[key_id/);
  assert.match(rowProblem(["key_x", M, 0, 0, 0, 0, "2026-12", 0, "", 0], 1), /field "rows\[1\]"\[0\] must be a key id/);
  assert.match(rowProblem(row("a", M, 1, 2, 0, 0, "2026-12", 0, "Monday"), 0), /\[8\] must be a day YYYY-MM-DD or ""/);
  assert.match(rowProblem(row("a", M, 1, 2, 0, 0, "2026-12", 0, "", -5), 0), /\[9\] must be a whole number >= 0/);
  // A row of the release before (no day of fallback spend) is read as spending none.
  assert.deepEqual(upgradeRow(row("a", M, 1, 2).slice(0, 8), EXCHANGE), [...row("a", M, 1, 2).slice(0, 8), "", 0]);
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

test("pushed leases are checked field by field", () => {
  const lease = ["key_0123456789ab", 3, null, "2026-12", 100, "2026-12-04", 5000];
  assert.equal(badLeases([lease]), null);
  assert.match(badLeases([[...lease.slice(0, 5), "today", 1]]), /\[5\] must be a day YYYY-MM-DD/);
  assert.match(badLeases([[...lease.slice(0, 6), -1]]), /\[6\] must be a whole number >= 0 or null/);
  assert.deepEqual(upgradeRow(lease.slice(0, 5), LEASE), [...lease.slice(0, 5), "", null]); // a ledger of the release before
  assert.match(badLeases("x"), /field "leases" must be an array/);
  assert.match(badLeases([lease, [1]]), /field "leases\[1\]" must be \[key_id/);
  assert.match(badLeases([["nope", 1, 1, "2026-12", 1, "", null]]), /"leases\[0\]"\[0\] must be a key id/);
  assert.match(badLeases([["key_0123456789ab", -1, 1, "2026-12", 1, "", null]]), /"leases\[0\]"\[1\] must be a whole number >= 0 or null \(got -1\)/);
  assert.match(badLeases([["key_0123456789ab", 1, 1.5, "2026-12", 1, "", null]]), /\[2\] must be a whole number/);
  assert.match(badLeases([["key_0123456789ab", 1, 1, "Dec", 1, "", null]]), /\[3\] must be a month YYYY-MM/);
});
