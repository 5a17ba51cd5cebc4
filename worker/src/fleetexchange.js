// @ts-check
// A fleet's exchange of limit counters and leases, the parts that are pure (plus the
// front door's poke): the row format, aligning a row to the current minute, summing the
// other cells', apportioning a key's limits to the cells as leases, and checking what
// arrives. The object that runs the exchange is fleetledger.js; each cell's generation
// stores what it is sent (generation.js setPeers) and hands its isolates the leases with
// their `counts`. See docs/fleet.md, "Limits across cells".
//
// A row is payloads.js EXCHANGE: one cell's (or the sum of several cells') requests and
// tokens in the minute bucket `minute` and the one before, and its tokens in `month`.

import { minuteOf } from "./limits.js";
import { log } from "./errors.js";
import { EXCHANGE, LEASE } from "./payloads.js";

const SHAPE_TEXT = `[${EXCHANGE.columns}]`;
export const MAX_ROWS = 5000; // rows per push (a body of at most ~400 KB)
const KEY_ID = /^key_[0-9a-f]{12}$/;
const MONTH = /^\d{4}-\d{2}$/;
const DAY = /^(\d{4}-\d{2}-\d{2})?$/; // "": no day counted
// Rows of the release before the fleet's fallback caps end at month_tokens: a cell or ledger of
// either version reads the other's during a deploy (no day, no fallback spend).
const OLD_EXCHANGE = EXCHANGE.day;
const OLD_LEASE = LEASE.day;

/** "YYYY-MM" (UTC) of t. */
export function monthOf(t) {
  return new Date(t).toISOString().slice(0, 7);
}

/** "YYYY-MM-DD" (UTC) of t. */
export function dayOf(t) {
  return new Date(t).toISOString().slice(0, 10);
}

/** A row of the release before, brought to the current shape (no day: nothing spent); others as they are. */
export function upgradeRow(row, shape) {
  if (!Array.isArray(row)) return row;
  if (shape === EXCHANGE && row.length === OLD_EXCHANGE) return [...row, "", 0];
  if (shape === LEASE && row.length === OLD_LEASE) return [...row, "", null];
  return row;
}

/**
 * A row's requests and tokens as seen at minute `m`: [req, tok, prev_req, prev_tok] of
 * buckets m and m - 1 (a row from an older minute has moved into "previous", or out).
 */
export function aligned(row, m) {
  const E = EXCHANGE;
  if (row[E.minute] === m) return [row[E.req], row[E.tok], row[E.prev_req], row[E.prev_tok]];
  if (row[E.minute] === m - 1) return [0, 0, row[E.req], row[E.tok]];
  return [0, 0, 0, 0];
}

/**
 * The sum of `rows` (one key, one row per cell) as a row at `now`: what the cells
 * together counted in this minute, the previous one and this month.
 */
export function sumRows(id, rows, now) {
  const month = monthOf(now);
  const day = dayOf(now);
  const out = EXCHANGE.zero(id, minuteOf(now));
  out[EXCHANGE.month] = month;
  out[EXCHANGE.day] = day;
  for (const r of rows) {
    const a = aligned(r, out[EXCHANGE.minute]);
    out[EXCHANGE.req] += a[0];
    out[EXCHANGE.tok] += a[1];
    out[EXCHANGE.prev_req] += a[2];
    out[EXCHANGE.prev_tok] += a[3];
    if (r[EXCHANGE.month] === month) out[EXCHANGE.month_tokens] += r[EXCHANGE.month_tokens];
    if (r[EXCHANGE.day] === day) out[EXCHANGE.fallback_microusd] += r[EXCHANGE.fallback_microusd];
  }
  // A sum stays a safe integer, as every row a cell accepts must be.
  for (const j of [EXCHANGE.req, EXCHANGE.tok, EXCHANGE.prev_req, EXCHANGE.prev_tok, EXCHANGE.month_tokens, EXCHANGE.fallback_microusd]) {
    out[j] = Math.min(out[j], Number.MAX_SAFE_INTEGER);
  }
  return out;
}

/** Whether a row counts anything (an all-zero peer row is deleted, not stored). */
export function counts(row) {
  const E = EXCHANGE;
  return Boolean(row[E.req] || row[E.tok] || row[E.prev_req] || row[E.prev_tok] || row[E.month_tokens] || row[E.fallback_microusd]);
}

/** null when `rows` (a push's body field) is an array of at most MAX_ROWS, else the message naming the field. */
export function badRows(rows) {
  if (!Array.isArray(rows)) return `field "rows" must be an array of ${SHAPE_TEXT}`;
  if (rows.length > MAX_ROWS) return `field "rows" holds at most ${MAX_ROWS} rows (got ${rows.length}): send them in parts`;
  return null;
}

/** null when row `i` is well formed, else the message naming its field. */
export function rowProblem(r, i) {
  const at = `field "rows[${i}]"`;
  if (!Array.isArray(r) || r.length !== EXCHANGE.length) return `${at} must be ${SHAPE_TEXT}`;
  if (typeof r[EXCHANGE.key_id] !== "string" || !KEY_ID.test(r[EXCHANGE.key_id])) {
    return `${at}[${EXCHANGE.key_id}] must be a key id: key_ and 12 hex digits (got ${JSON.stringify(r[EXCHANGE.key_id])})`;
  }
  for (let j = 0; j < EXCHANGE.length; j++) {
    if (j === EXCHANGE.key_id || j === EXCHANGE.month || j === EXCHANGE.day) continue;
    if (!Number.isSafeInteger(r[j]) || r[j] < 0) return `${at}[${j}] must be a whole number >= 0 (got ${JSON.stringify(r[j])})`;
  }
  if (typeof r[EXCHANGE.month] !== "string" || !MONTH.test(r[EXCHANGE.month])) {
    return `${at}[${EXCHANGE.month}] must be a month YYYY-MM (got ${JSON.stringify(r[EXCHANGE.month])})`;
  }
  if (typeof r[EXCHANGE.day] !== "string" || !DAY.test(r[EXCHANGE.day])) {
    return `${at}[${EXCHANGE.day}] must be a day YYYY-MM-DD or "" (got ${JSON.stringify(r[EXCHANGE.day])})`;
  }
  return null;
}

// --- leases: each cell's share of a key's limit ---
//
// A lease caps what one cell admits of a key: its own sliding-window estimate of requests
// (or tokens) for rpm (tpm), its own tokens this month for monthly_tokens. The ledger keeps
// the leases of a key, together with what each cell has already used, within the key's
// cap = limit + slack (10 %, at least 1), so the fleet never passes the cap, while a cell
// a key uses alone gets nearly all of it.

/** What a key's leases may add up to beyond its limit: 10 % of it, at least 1. */
export function slackOf(limit) {
  return Math.max(1, Math.floor(limit / 10));
}

/** A cell's lease of a key the ledger has not apportioned yet: the cap split evenly. */
export function defaultShare(limit, n) {
  return Math.floor((limit + slackOf(limit)) / n);
}

/**
 * The least the ledger counts a cell as admitting of a limit, whatever its lease: what an
 * isolate may admit of a key it holds but whose lease it does not (it forgot the key's lease
 * after SERVED_KEEP_MS idle, state.js; the ledger may have cut the lease since), until its next
 * sync brings the lease. A share of the slack, so a key alone in one cell still gets ≥ 90 % of
 * its limit there, and at most the default share (0 where the cells' floors would pass the cap).
 */
export function floorShare(limit, n) {
  if (n < 2) return defaultShare(limit, Math.max(n, 1));
  return Math.min(defaultShare(limit, n), Math.max(1, Math.floor(slackOf(limit) / (n - 1))));
}

/**
 * A cell's lease of a key the ledger has not apportioned there: `share` (the default share,
 * as the ledger counts a cell without a lease row; floorShare for an isolate that holds the
 * key but not its lease) of each limit the key has, no peers known. undefined for a lone
 * cell (`cells` 0) or a key without limits.
 */
export function provisionalLease(key, cells, keyCap = 0, share = defaultShare) {
  const fallback = fallbackCapOf(key, keyCap);
  if (!cells || !(key.rpm > 0 || key.tpm > 0 || key.monthly_tokens > 0 || fallback > 0)) return undefined;
  return {
    req: key.rpm > 0 ? share(key.rpm, cells) : null,
    tok: key.tpm > 0 ? share(key.tpm, cells) : null,
    month_tokens: key.monthly_tokens > 0 ? share(key.monthly_tokens, cells) : null,
    fallback_microusd: fallback > 0 ? share(fallback, cells) : null,
    peers: null,
  };
}

/**
 * A key's daily cap on the fallback's spend as a cell holds it (millionths of a dollar): its
 * own (fallback_microusd_day), else the cell's per-key cap `keyCap` (0: none); what the
 * ledger apportions across the fleet as it does a monthly budget (spendcap.js reads the share).
 */
export function fallbackCapOf(key, keyCap = 0) {
  return key.fallback_microusd_day > 0 ? key.fallback_microusd_day : keyCap;
}

/**
 * The leases one limit should have (integers), given what each cell has used (its own
 * estimate now): the unused part of the cap split over the cells by `weight` (the ledger
 * weighs a cell the key used lately as four idle ones: an idle cell's share is what lets a
 * key move there at once, an active one's what it grows into before the next round), no
 * cell above the limit itself (its excess goes to the others), and the units lost to
 * rounding down given first to cells with none (so a key alone in one of three cells with rpm 10 settles at 9 there, 1 in each
 * other). What the cells may admit, the larger of used and lease each, sums to at most the cap.
 */
export function fairShares(limit, used, weight = used.map(() => 1)) {
  const n = used.length;
  const cap = limit + slackOf(limit);
  const free = Math.max(0, cap - used.reduce((a, b) => a + b, 0));
  const total = weight.reduce((a, b) => a + b, 0);
  const t = used.map((u, j) => Math.min(u, limit) + (free * weight[j]) / total);
  // Water-fill: what a cell cannot take above the limit goes to those below it, by weight.
  for (let pass = 0; pass < n; pass++) {
    let over = 0;
    const below = [];
    for (let j = 0; j < n; j++) {
      if (t[j] > limit) {
        over += t[j] - limit;
        t[j] = limit;
      } else if (t[j] < limit) below.push(j);
    }
    if (over <= 1e-9 || below.length === 0) break;
    const wb = below.reduce((a, j) => a + weight[j], 0);
    for (const j of below) t[j] += (over * weight[j]) / wb;
  }
  const out = t.map((x) => Math.floor(x + 1e-9));
  let left = cap - out.reduce((a, x, j) => a + Math.max(used[j], x), 0);
  // Cells with none first, then the largest part lost to rounding.
  const order = [...out.keys()].sort((a, b) => Number(out[b] === 0) - Number(out[a] === 0) || (t[b] - out[b]) - (t[a] - out[a]) || a - b);
  for (const j of order) {
    const more = out[j] + 1 - Math.max(used[j], out[j]); // what one unit more adds to what the cells may admit
    if (out[j] + 1 <= limit && more <= left + 1e-9 && (out[j] === 0 || t[j] - out[j] > 1e-9)) {
      out[j] += 1;
      left -= Math.max(0, more);
    }
  }
  return out;
}

export const ACTIVE_WEIGHT = 4;

/**
 * Each cell's weight in a key's shares, from what the ledger saw of it lately (`seen[j]`:
 * set while the cell moved the key's counters in the last few seconds, else undefined):
 * ACTIVE_WEIGHT for an active cell, 1 for an idle one. An idle cell's share is then small
 * when a key leaves it (its surplus is held until a decrease lands), yet enough to start a
 * move there: increases land within about a round and a sync. (Weighing active cells by
 * their rate instead starved a move's first seconds and admitted no more in the bench.)
 */
export function weights(seen) {
  return seen.map((x) => (x ? ACTIVE_WEIGHT : 1));
}

/**
 * The leases the ledger may send now, toward `targets`: increases only within cap - what
 * the other cells may still admit, where a cell may admit up to the larger of what it has
 * used and the largest lease it may still be using (`held`: an older, larger lease stays
 * held until the cell has certainly stopped using it). So the sum over cells of
 * max(used, held) never passes the cap. Decreases at once, but never so far that what the
 * cells may admit under the new leases, the sum of max(used, lease), falls below the limit:
 * until a decrease lands, the ledger holds the old lease against the cap, so an increase
 * elsewhere waits for it, and a deeper cut would leave a key refused by every cell while
 * under its limit (the front door tries each). A share then moves by about the slack each
 * time a cut lands (docs/fleet.md). Returns {lease, held} per cell.
 */
export function grant(limit, used, held, current, targets) {
  const cap = limit + slackOf(limit);
  const n = used.length;
  const lease = [...current];
  const hold = [...held];
  for (let j = 0; j < n; j++) if (targets[j] < current[j]) lease[j] = targets[j];
  for (let j = 0; j < n; j++) {
    if (targets[j] <= current[j]) continue;
    let others = 0;
    for (let k = 0; k < n; k++) if (k !== j) others += Math.max(used[k], hold[k]);
    const room = Math.floor(cap - others + 1e-9);
    lease[j] = Math.max(current[j], Math.min(targets[j], room));
    hold[j] = Math.max(hold[j], lease[j]);
  }
  // Give back what the cuts took, the deepest cut first, never above the current lease.
  const cut = [...lease.keys()].filter((j) => lease[j] < current[j])
    .sort((a, b) => current[b] - lease[b] - (current[a] - lease[a]) || a - b);
  for (const j of cut) {
    const short = Math.ceil(limit - lease.reduce((a, x, k) => a + Math.max(used[k], x), 0) - 1e-9);
    if (short <= 0) break;
    lease[j] = Math.min(current[j], Math.max(lease[j], Math.ceil(used[j] - 1e-9)) + short);
  }
  return { lease, held: hold };
}

export const MAX_CELLS = 64; // a push's "cells" (the fleet's size) is checked against it
const LEASE_TEXT = `[${LEASE.columns}]`;

/** null when `leases` (a push's body field, rows of payloads.js LEASE) is well formed, else the message naming the field. */
export function badLeases(leases) {
  if (!Array.isArray(leases)) return `field "leases" must be an array of ${LEASE_TEXT}`;
  if (leases.length > MAX_ROWS) return `field "leases" holds at most ${MAX_ROWS} rows (got ${leases.length}): send them in parts`;
  for (let i = 0; i < leases.length; i++) {
    const r = leases[i];
    const at = `field "leases[${i}]"`;
    if (!Array.isArray(r) || r.length !== LEASE.length) return `${at} must be ${LEASE_TEXT}`;
    if (typeof r[LEASE.key_id] !== "string" || !KEY_ID.test(r[LEASE.key_id])) {
      return `${at}[${LEASE.key_id}] must be a key id: key_ and 12 hex digits (got ${JSON.stringify(r[LEASE.key_id])})`;
    }
    for (const j of [LEASE.req, LEASE.tok, LEASE.month_tokens, LEASE.fallback_microusd]) {
      if (r[j] !== null && (!Number.isSafeInteger(r[j]) || r[j] < 0)) {
        return `${at}[${j}] must be a whole number >= 0 or null (got ${JSON.stringify(r[j])})`;
      }
    }
    if (typeof r[LEASE.month] !== "string" || !MONTH.test(r[LEASE.month])) {
      return `${at}[${LEASE.month}] must be a month YYYY-MM (got ${JSON.stringify(r[LEASE.month])})`;
    }
    if (typeof r[LEASE.day] !== "string" || !DAY.test(r[LEASE.day])) {
      return `${at}[${LEASE.day}] must be a day YYYY-MM-DD or "" (got ${JSON.stringify(r[LEASE.day])})`;
    }
  }
  return null;
}

/**
 * The well-formed rows, and the problems of the others: one bad row (a counter past 2^53,
 * a broken cell) is dropped, never the batch, so one key cannot stop the fleet's limits
 * for every other key.
 */
export function goodRows(rows) {
  const good = [];
  const dropped = [];
  for (let i = 0; i < rows.length; i++) {
    const problem = rowProblem(rows[i], i);
    if (problem === null) good.push(rows[i]);
    else dropped.push(problem);
  }
  return { good, dropped };
}

// --- the front door's poke: the ledger's alarm runs only while the fleet is used ---

export const LEDGER_NAME = "ledger";
export const POKE_EVERY_MS = 10_000; // per isolate; the ledger keeps going QUIET_MS after the last poke
let lastPoke = -Infinity; // module scope: one isolate
let ledgerId = null; // a DurableObjectId is plain data, safe to keep

/**
 * Tell the ledger the fleet is in use, at most once per isolate per max(exchange period,
 * POKE_EVERY_MS), in the background: never awaited by a request.
 */
export function pokeLedger(env, ctx, cfg, t = Date.now()) {
  if (t - lastPoke < Math.max(cfg.exchangeMs, POKE_EVERY_MS)) return false;
  lastPoke = t;
  ledgerId ??= env.LEDGER.idFromName(LEDGER_NAME);
  ctx.waitUntil(Promise.resolve()
    .then(() => env.LEDGER.get(ledgerId).poke())
    .catch((err) => log(env, "ledger_unreachable", { message: String(err && err.message) })));
  return true;
}

/** Forget the last poke (tests). */
export function forgetPoke() {
  lastPoke = -Infinity;
}
