// @ts-check
// Client-key limits, pure: the clock and the counters are passed in.
//
// Requests and tokens per minute use a sliding-window estimate over fixed one-minute
// buckets (previous bucket weighted by the part of it still inside the last 60 s, plus
// the current bucket), the same approximation Cloudflare's rate limiting uses; the
// monthly token budget counts UTC calendar months. The counters are the object's global
// ones as of the isolate's last sync plus what this isolate admitted since (its pending
// deltas), so an isolate never forgets its own traffic; what other isolates admitted
// since their last sync is the overshoot bound documented in docs/worker.md. The same
// holds for requests in flight (max_parallel): this isolate's own count is exact, the
// other isolates' is as of their last sync.

import { COUNTER } from "./payloads.js";
import { promptCount } from "./usage.js";

export const WINDOW_MS = 60_000;

export function minuteOf(t) {
  return Math.floor(t / WINDOW_MS);
}

const DAY_MS = 86_400_000;
let lastDay = { n: NaN, text: "" }; // one formatting per UTC day, not one per request

/** "YYYY-MM-DD" (UTC). */
export function dayOf(t) {
  const n = Math.floor(t / DAY_MS);
  if (n !== lastDay.n) lastDay = { n, text: new Date(n * DAY_MS).toISOString().slice(0, 10) };
  return lastDay.text;
}

/** The first day of t's UTC month, "YYYY-MM-01". */
export function monthStartDay(t) {
  return new Date(t).toISOString().slice(0, 8) + "01";
}

function msToNextMonth(t) {
  const d = new Date(t);
  return Date.UTC(d.getUTCFullYear(), d.getUTCMonth() + 1, 1) - t;
}

/**
 * The global count of a key's bucket `m` as of the last sync: `g` is the object's
 * counter row (payloads.js COUNTER) for that key, or undefined.
 */
function globalAt(g, m) {
  if (!g) return { req: 0, tok: 0 };
  if (m === g[COUNTER.minute]) return { req: g[COUNTER.req], tok: g[COUNTER.tok] };
  if (m === g[COUNTER.minute] - 1) return { req: g[COUNTER.prev_req], tok: g[COUNTER.prev_tok] };
  return { req: 0, tok: 0 };
}

/**
 * Estimated requests and tokens in the last minute at `t`.
 * @param g        the object's counters for this key (may be undefined)
 * @param pending  (minute) => {req, tok} this isolate's unsynced deltas for this key
 */
export function estimate(g, pending, t) {
  const m = minuteOf(t);
  const frac = (t - m * WINDOW_MS) / WINDOW_MS;
  const cur = globalAt(g, m);
  const prev = globalAt(g, m - 1);
  const pc = pending(m);
  const pp = pending(m - 1);
  const w = 1 - frac;
  const prevReq = prev.req + pp.req;
  const curReq = cur.req + pc.req;
  const prevTok = prev.tok + pp.tok;
  const curTok = cur.tok + pc.tok;
  // the parts too: when the estimate falls below a limit depends on each (msUntilBelow)
  return { req: prevReq * w + curReq, tok: prevTok * w + curTok, prevReq, curReq, prevTok, curTok };
}

/**
 * Milliseconds from `t` until a sliding-window count made of `prev` (the minute before t's)
 * and `cur` (t's minute) is below `limit`, if nothing more is admitted: the previous
 * minute's weight falls to 0 over t's minute, and t's minute's count weighs in until the
 * end of the next one. 0 when it is below already.
 */
export function msUntilBelow(prev, cur, limit, t) {
  const into = t % WINDOW_MS;
  if (prev * (1 - into / WINDOW_MS) + cur < limit) return 0;
  if (cur < limit) return Math.ceil((1 - (limit - cur) / prev) * WINDOW_MS - into) + 1;
  return WINDOW_MS - into + Math.ceil((1 - limit / cur) * WINDOW_MS) + 1;
}

// A sliding minute admits again within a minute of any moment (unless other isolates
// admitted past the limit meanwhile): Retry-After and x-ratelimit-reset-* never say more.
const MAX_WAIT_MS = WINDOW_MS;

/** OpenAI's duration form for x-ratelimit-reset-*: "0s", "12s", "1m0s". */
function resetText(ms) {
  const s = Math.ceil(ms / 1000);
  return s < 60 ? `${s}s` : `${Math.floor(s / 60)}m${s % 60}s`;
}

/**
 * OpenAI's rate-limit headers for a key's requests and tokens per minute, as [name, value]
 * pairs (only for the limits the key has), with this request counted when `admitted`.
 * x-ratelimit-reset-* is when the window admits the next request (0s while some remains):
 * on a 429 the same wait as its Retry-After, at most a minute. `reserved`:
 * tokens the key's requests in flight reserved, counted as used until they settle.
 * Clients and SDKs read them to pace themselves (docs/worker.md, "Using it").
 */
export function rateHeaders(key, est, t, admitted, reserved = 0) {
  const out = [];
  if (key.rpm > 0) {
    const used = est.req + (admitted ? 1 : 0);
    out.push(["x-ratelimit-limit-requests", String(key.rpm)],
      ["x-ratelimit-remaining-requests", String(Math.max(0, Math.floor(key.rpm - used)))],
      ["x-ratelimit-reset-requests", resetText(Math.min(MAX_WAIT_MS, msUntilBelow(est.prevReq, est.curReq + (admitted ? 1 : 0), key.rpm, t)))]);
  }
  if (key.tpm > 0) {
    out.push(["x-ratelimit-limit-tokens", String(key.tpm)],
      ["x-ratelimit-remaining-tokens", String(Math.max(0, Math.floor(key.tpm - est.tok - reserved)))],
      ["x-ratelimit-reset-tokens", resetText(Math.min(MAX_WAIT_MS, msUntilBelow(est.prevTok, est.curTok, key.tpm, t)))]);
  }
  return out;
}

// What a request asks of its key's limits, once its body is known (nothing before it):
//   tokens          the most it can cost (`mostTokens`): what tpm and monthly_tokens check it
//                   for, as OpenAI checks a request's prompt and max_tokens against its limits
//   prompt          its prompt tokens at most (usage.js usageCeiling): max_parallel_tokens's
//   promptInflight  the key's prompt tokens in flight already, not begun at a pod
//   promptLimit     the key's max_parallel_tokens (a key made before it had one: the cell's default)
export const NO_ASK = Object.freeze({ tokens: 0, prompt: 0, promptInflight: 0, promptLimit: 0 });

/**
 * The most tokens a request can be counted (its reservation and what admission checks):
 * its ceiling's prompt and completion, and never past the context for each prompt and
 * sequence, since vLLM fits a sequence's prompt and answer in `maxModelLen` (it clamps
 * max_tokens to what fits): a request without max_tokens asks one context, not two.
 */
export function mostTokens(json, ceiling, maxModelLen) {
  const n = Math.max(json && Number.isInteger(json.n) && json.n > 0 ? json.n : 1,
    json && Number.isInteger(json.best_of) && json.best_of > 0 ? json.best_of : 1);
  return Math.min(ceiling.prompt + ceiling.completion, promptCount(json) * n * maxModelLen);
}

/**
 * Whether a request can never fit one of its key's limits, however long it waits: null, or
 * {param, message} (a 400 naming the limit and the fix). `ask` as for `refusal`, `json` the
 * body (which field to name).
 */
export function neverFits(key, ask, json) {
  const chat = !!json && json.messages !== undefined;
  const promptParam = chat ? "messages" : "prompt";
  const answerParam = chat && json.max_completion_tokens !== undefined && json.max_completion_tokens !== null ? "max_completion_tokens" : "max_tokens";
  const most = `this request may use ${ask.tokens} tokens (its prompt, at most one token a byte of the body, and ${answerParam} for each answer)`;
  for (const [limit, what, setting] of [[key.tpm, "tokens per minute", "tpm"], [key.monthly_tokens, "tokens a month", "monthly_tokens"]]) {
    if (limit > 0 && ask.tokens > limit) {
      const param = ask.prompt >= limit ? promptParam : answerParam;
      return { param, message: `${most}, more than this key's ${limit} ${what} (its ${setting}): `
        + (param === answerParam ? `set ${answerParam} to at most ${Math.max(1, limit - ask.prompt)}` : "send a shorter prompt")
        + ", or ask the operator for a larger limit" };
    }
  }
  const mpt = ask.promptLimit;
  if (mpt > 0 && ask.prompt > mpt) {
    return { param: promptParam, message: `this request's prompt may be ${ask.prompt} tokens (one a byte of the body, at most the `
      + `context for each prompt), more than this key's max_parallel_tokens (${mpt} prompt tokens in flight at once): send a shorter `
      + "prompt or fewer prompts a request, or ask the operator for a larger max_parallel_tokens" };
  }
  return null;
}

/**
 * Whether a key may send one more request now: null, or the refusal
 * {type, code, message, retryAfterS} (HTTP 429). `inflight`: its requests in flight in
 * every isolate as far as this one knows; `reserved`: what they reserved. `ask`: what this
 * request asks (NO_ASK before its body is read: then only a limit already used up refuses).
 * A request that can never fit is `neverFits`'s, checked first.
 */
export function refusal(key, est, monthTokens, t, inflight = 0, reserved = 0, ask = NO_ASK) {
  // Retry-After: when the window will admit the next request (not the end of the minute).
  const wait = (prev, cur, limit) => Math.max(1, Math.ceil(Math.min(MAX_WAIT_MS, msUntilBelow(prev, cur, limit, t)) / 1000));
  if (key.rpm > 0 && est.req >= key.rpm) {
    return { type: "requests", code: "rate_limit_exceeded", retryAfterS: wait(est.prevReq, est.curReq, key.rpm),
      message: `rate limit reached: ${key.rpm} requests per minute for this key` };
  }
  if (key.tpm > 0 && est.tok >= key.tpm) {
    return { type: "tokens", code: "rate_limit_exceeded", retryAfterS: wait(est.prevTok, est.curTok, key.tpm),
      message: `rate limit reached: ${key.tpm} tokens per minute for this key` };
  }
  if (key.monthly_tokens > 0 && monthTokens >= key.monthly_tokens) {
    return { type: "insufficient_quota", code: "insufficient_quota", retryAfterS: Math.max(1, Math.ceil(msToNextMonth(t) / 1000)),
      message: `monthly token budget used: ${key.monthly_tokens} tokens this month for this key` };
  }
  // Under both, but not once the key's requests in flight use what they reserved: the
  // reservations settle when those requests end, so Retry-After is 1 s (docs/worker.md,
  // "What a request may cost").
  if (reserved > 0 && ((key.tpm > 0 && est.tok + reserved >= key.tpm)
      || (key.monthly_tokens > 0 && monthTokens + reserved >= key.monthly_tokens))) {
    const which = key.tpm > 0 && est.tok + reserved >= key.tpm ? `${key.tpm} tokens per minute` : `${key.monthly_tokens} tokens this month`;
    return reservedRefusal(which, reserved);
  }
  // This request's own most must fit beside what was used and reserved.
  const asked = ask.tokens;
  if (asked > 0 && key.tpm > 0 && est.tok + reserved + asked > key.tpm) {
    if (reserved > 0 && est.tok + asked <= key.tpm) return reservedRefusal(`${key.tpm} tokens per minute`, reserved);
    const room = key.tpm - reserved - asked; // >= 0: a request over the limit alone is neverFits's
    return { type: "tokens", code: "rate_limit_exceeded", retryAfterS: wait(est.prevTok, est.curTok, room + 1),
      message: `rate limit reached: ${key.tpm} tokens per minute for this key, ${Math.ceil(est.tok + reserved)} used or reserved, `
        + `and this request may use ${asked}: retry later, or lower max_tokens` };
  }
  if (asked > 0 && key.monthly_tokens > 0 && monthTokens + reserved + asked > key.monthly_tokens) {
    if (reserved > 0 && monthTokens + asked <= key.monthly_tokens) return reservedRefusal(`${key.monthly_tokens} tokens this month`, reserved);
    return { type: "insufficient_quota", code: "insufficient_quota", retryAfterS: Math.max(1, Math.ceil(msToNextMonth(t) / 1000)),
      message: `monthly token budget: this request may use ${asked} tokens and this key has ${Math.max(0, key.monthly_tokens - monthTokens)} `
        + `of its ${key.monthly_tokens} left this month: lower max_tokens (or send a shorter prompt)` };
  }
  if (key.max_parallel > 0 && inflight >= key.max_parallel) {
    return { type: "requests", code: "too_many_parallel_requests", retryAfterS: 1,
      message: `too many requests in flight: ${key.max_parallel} at a time for this key` };
  }
  // The key's prompts waiting for a pod's first token (max_parallel_tokens): one key cannot
  // fill a pod's prefill queue for everyone (docs/worker.md, "Busy is not broken").
  const mpt = ask.promptLimit;
  if (mpt > 0 && (ask.promptInflight >= mpt || ask.promptInflight + ask.prompt > mpt)) {
    return { type: "tokens", code: "too_many_parallel_tokens", retryAfterS: 1,
      message: `too many prompt tokens in flight: this key's requests not yet begun at a pod hold ${ask.promptInflight} of its `
        + `${mpt} (max_parallel_tokens)${ask.prompt > 0 ? ` and this request's prompt may be ${ask.prompt}` : ""}; retry when they begin` };
  }
  return null;
}

function reservedRefusal(which, reserved) {
  return { type: "tokens", code: "tokens_reserved", retryAfterS: 1,
    message: `rate limit reached: this key's requests in flight may use the rest of its ${which} (${reserved} tokens reserved); `
      + "retry when they finish" };
}

/**
 * In a fleet, whether this cell's lease of the key ({req, tok, month_tokens}: its share of
 * the key's limits, docs/fleet.md "Limits across cells") leaves room for one more request:
 * null, or the refusal. `est` and `monthTokens` are this cell's own. A request must fit
 * whole in each lease, so the cells' counts never sum past the leases: for tokens, unknown
 * until served, a request is taken to cost what this cell's requests of the key cost on
 * average this minute. Retry-After is 1 s: the lease may grow within a round or two.
 */
export function leaseRefusal(key, lease, est, monthTokens, reserved = 0) {
  if (lease.req !== null && est.req + 1 > lease.req) {
    return { type: "requests", code: "rate_limit_exceeded", retryAfterS: 1, byLease: true,
      message: `rate limit reached: this cell's share of ${key.rpm} requests per minute for this key is in use` };
  }
  const perRequest = est.req > 0 ? est.tok / est.req : 0;
  const tok = est.tok + reserved; // what the requests in flight reserved counts as used
  monthTokens += reserved;
  if (lease.tok !== null && (tok >= lease.tok || tok + perRequest > lease.tok)) {
    return { type: "tokens", code: "rate_limit_exceeded", retryAfterS: 1, byLease: true,
      message: `rate limit reached: this cell's share of ${key.tpm} tokens per minute for this key is in use` };
  }
  if (lease.month_tokens !== null && (monthTokens >= lease.month_tokens || monthTokens + perRequest > lease.month_tokens)) {
    return { type: "insufficient_quota", code: "insufficient_quota", retryAfterS: 1, byLease: true,
      message: `monthly token budget: this cell's share of ${key.monthly_tokens} tokens this month for this key is in use` };
  }
  return null;
}

const NOTHING_PENDING = () => ({ req: 0, tok: 0 });

/**
 * Whether a key this cell refused by its lease is under its own limits over the fleet as
 * this cell knows them: its own counts (`est`, `monthTokens`) plus the other cells' as the
 * exchange last brought them (`lease.peers`, a COUNTER row or null). Then another cell's
 * lease may admit it, and the front door may try one (docs/fleet.md, "A key that moves").
 * The peers' counts lag by a round: a key just over its limit may be called under it,
 * which costs the fleet's other cells one refusal each, never an admission past a lease.
 */
export function underFleetLimit(key, lease, est, monthTokens, t) {
  const p = lease.peers ? estimate(lease.peers, NOTHING_PENDING, t) : null;
  const sum = p === null ? est : {
    req: est.req + p.req, tok: est.tok + p.tok, prevReq: est.prevReq + p.prevReq, curReq: est.curReq + p.curReq,
    prevTok: est.prevTok + p.prevTok, curTok: est.curTok + p.curTok,
  };
  const month = monthTokens + (lease.peers ? lease.peers[COUNTER.month_tokens] : 0);
  return refusal(key, sum, month, t, 0) === null;
}
