// @ts-check
// A fleet's exchange of limit counters, the parts that are pure (plus the front door's
// poke): the row format, aligning a row to the current minute, summing the other cells',
// and checking rows that arrive. The object that runs the exchange is fleetledger.js;
// each cell's generation stores what it is sent (generation.js setPeers) and adds it to
// the `counts` its isolates read. See docs/fleet.md, "Limits across cells".
//
// A row is payloads.js EXCHANGE: one cell's (or the sum of several cells') requests and
// tokens in the minute bucket `minute` and the one before, and its tokens in `month`.

import { minuteOf } from "./limits.js";
import { log } from "./errors.js";
import { COUNTER, EXCHANGE } from "./payloads.js";

const SHAPE_TEXT = `[${EXCHANGE.columns}]`;
export const MAX_ROWS = 5000; // rows per push (a body of at most ~400 KB)
const KEY_ID = /^key_[0-9a-f]{12}$/;
const MONTH = /^\d{4}-\d{2}$/;

/** "YYYY-MM" (UTC) of t. */
export function monthOf(t) {
  return new Date(t).toISOString().slice(0, 7);
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

/** Add a peer row into a sync's counters `c` (payloads.js COUNTER) at `now`. */
export function addPeer(c, row, now) {
  const a = aligned(row, minuteOf(now));
  c[COUNTER.req] += a[0];
  c[COUNTER.tok] += a[1];
  c[COUNTER.prev_req] += a[2];
  c[COUNTER.prev_tok] += a[3];
  if (row[EXCHANGE.month] === monthOf(now)) c[COUNTER.month_tokens] += row[EXCHANGE.month_tokens];
  return c;
}

/**
 * The sum of `rows` (one key, one row per cell) as a row at `now`: what the cells
 * together counted in this minute, the previous one and this month.
 */
export function sumRows(id, rows, now) {
  const month = monthOf(now);
  const out = EXCHANGE.zero(id, minuteOf(now));
  out[EXCHANGE.month] = month;
  for (const r of rows) {
    const a = aligned(r, out[EXCHANGE.minute]);
    out[EXCHANGE.req] += a[0];
    out[EXCHANGE.tok] += a[1];
    out[EXCHANGE.prev_req] += a[2];
    out[EXCHANGE.prev_tok] += a[3];
    if (r[EXCHANGE.month] === month) out[EXCHANGE.month_tokens] += r[EXCHANGE.month_tokens];
  }
  // A sum stays a safe integer, as every row a cell accepts must be.
  for (const j of [EXCHANGE.req, EXCHANGE.tok, EXCHANGE.prev_req, EXCHANGE.prev_tok, EXCHANGE.month_tokens]) {
    out[j] = Math.min(out[j], Number.MAX_SAFE_INTEGER);
  }
  return out;
}

/** Whether a row counts anything (an all-zero peer row is deleted, not stored). */
export function counts(row) {
  const E = EXCHANGE;
  return Boolean(row[E.req] || row[E.tok] || row[E.prev_req] || row[E.prev_tok] || row[E.month_tokens]);
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
    if (j === EXCHANGE.key_id || j === EXCHANGE.month) continue;
    if (!Number.isSafeInteger(r[j]) || r[j] < 0) return `${at}[${j}] must be a whole number >= 0 (got ${JSON.stringify(r[j])})`;
  }
  if (typeof r[EXCHANGE.month] !== "string" || !MONTH.test(r[EXCHANGE.month])) {
    return `${at}[${EXCHANGE.month}] must be a month YYYY-MM (got ${JSON.stringify(r[EXCHANGE.month])})`;
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
