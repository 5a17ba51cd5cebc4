// @ts-check
// The Worker's side of the generation object: which object, the cached view, the
// batched deltas (usage, limit counters, requests in flight), key look-ups, and breaker
// reports.
//
// One mechanism keeps the isolate and the object in step: `sync` sends this isolate's
// pending deltas and receives the current view in the same round trip. It runs
//   - in the background from half the TTL on (refresh-ahead, never a wait),
//   - at most FLUSH_MAX_MS after a request recorded usage (ctx.waitUntil timer),
//   - in the foreground only when the view is stale (cold/idle isolate, STATE_TTL_MS = 0).
// A sync carries what changed, never the whole state: the key rows changed since the
// revision this isolate holds, and the counters of the keys it served in the last two
// minutes (`info.keys`). A key this isolate does not hold is looked up alone
// (`lookupKeys`): digests asked for at once share one call, at most one call per
// LOOKUP_EVERY_MS per isolate, and digests still unknown are remembered (cache.js).
// Every call passes `info` (generation names, the machine's numbers, the revision held,
// this isolate's id) so the object needs no bindings of its own beyond BREAKER (the
// generation objects' namespace, named after their class).

import { HttpError, log } from "./errors.js";
import { ViewCache } from "./cache.js";
import { dayOf, minuteOf } from "./limits.js";
import { healthDue, inflightMoved, inflightOf, takeInflightMoved } from "./pods.js";
import { now } from "./timing.js";
import { recorder, takeHist } from "./histogram.js";
import { BACKEND, COUNTER, FALLBACK_HELD, INFLIGHT, REFUSAL, USAGE, WINDOW } from "./payloads.js";

export const cache = new ViewCache(); // module scope: lives as long as the isolate
const ids = new Map(); // generation -> DurableObjectId (plain data, safe to keep)
const pending = new Map(); // generation -> pending deltas (see pendingOf)

const FLUSH_MAX_MS = 1000; // usage reaches the object at most this long after a request
const FLUSH_RETRIES = 3; // a failed flush is tried again this many times (flush)
const FLUSH_RETRY_MIN_MS = 250;
// A key's counters (and fleet lease) are asked for this long after it was served:
// config.js servedKeepMs (SERVED_KEEP_MS, colocate:worker.servedKeepMs), 120 s by default.
export const LOOKUP_EVERY_MS = 250; // key look-ups: at most one call per isolate this often (after a burst of 2)
const LOOKUP_BURST = 2;
const LOOKUP_BATCH = 100; // digests per look-up call
const LOOKUP_WAITING_MAX = 2000; // digests waiting for a look-up; past it new ones are told to retry
const LOOKUP_WAIT_MS = 5000; // how long a request waits for its digest's look-up
const MORE_PAGES_MAX = 20; // a sync follows `more: true` at most this many times

let isolateId = null; // random per isolate; made on first use (no randomness at module load in Workers)
function isolate() {
  isolateId ??= "iso_" + crypto.randomUUID();
  return isolateId;
}

/** The stub of a generation's object, always reached with its location hint (the hint
 * only matters on the very first get() of a name, but passing it is never wrong). */
export function stubFor(env, generation, hint) {
  let id = ids.get(generation);
  if (!id) {
    id = env.BREAKER.idFromName(generation);
    ids.set(generation, id);
  }
  return hint ? env.BREAKER.get(id, { locationHint: hint }) : env.BREAKER.get(id);
}

/**
 * What every object call carries; `keys`: the ids whose counters a sync asks for.
 * @returns {import("./payloads.js").SyncInfo}
 */
export function infoOf(cfg, keys = []) {
  return {
    generation: cfg.activeGeneration,
    draining: cfg.drainingGeneration,
    drainingHint: cfg.drainingHint,
    failureThreshold: cfg.failureThreshold,
    openMs: cfg.openMs,
    deadlineMs: cfg.deadlineMs,
    haveRev: cache.rev(cfg.activeGeneration),
    isolate: isolate(),
    ttlMs: cfg.stateTtlMs,
    keys,
    capCell: cfg.fallbackSpend.cellMicroUsd > 0,
    capKeys: cfg.fallbackSpend.price !== null, // a key may hold a cap of its own
    keyCap: cfg.fallbackSpend.price !== null ? cfg.fallbackSpend.keyMicroUsd : 0, // a fleet leases each key's cap
  };
}

export function activeStub(env, cfg) {
  return stubFor(env, cfg.activeGeneration, cfg.activeHint);
}

// keys: null = unknown: the router answers 503 rather than call every key invalid.
const EMPTY_VIEW = Object.freeze({ rev: -1, keys: null, pods: {}, counts: {}, forced: null, imported: [], at: 0 });

/**
 * The cache entry if it may be used without waiting, else null (stale: call
 * currentView). Synchronous, so the warm hot path has no await for it.
 */
export function freshEntry(env, ctx, cfg) {
  const gen = cfg.activeGeneration;
  const t = Date.now();
  const status = cache.status(gen, t, cfg.stateTtlMs);
  if (status === "stale") return null;
  if (status === "refresh") {
    cache.markRefreshing(gen, t);
    ctx.waitUntil(sync(env, cfg).catch(syncFailed(env, gen)));
  }
  return cache.entry(gen);
}

/**
 * The cache entry a request routes on, and how long it waited for it (ms). Fresh:
 * no wait, no I/O. Half-way to stale: no wait, sync in the background.
 */
export async function currentView(env, ctx, cfg, lookup = null) {
  const entry = freshEntry(env, ctx, cfg);
  if (entry !== null) return { entry, wait: 0 };
  const gen = cfg.activeGeneration;
  const t = now();
  try {
    return { entry: await sync(env, cfg, lookup), wait: now() - t };
  } catch (err) {
    // The object is unreachable: route on what we last knew (or nothing: closed, no keys)
    // rather than fail every request.
    log(env, "state_unavailable", { generation: gen, error: String(err && err.message) });
    return { entry: cache.entry(gen) ?? cache.put(gen, EMPTY_VIEW, -Infinity), wait: now() - t };
  }
}

/** The ids served here in the last `keepMs` (older ones are forgotten, counters too). */
function servedKeys(gen, t, keepMs) {
  const p = pending.get(gen);
  if (!p) return [];
  const gone = [];
  for (const [id, at] of p.served) if (t - at >= keepMs) gone.push(id);
  for (const id of gone) p.served.delete(id);
  if (gone.length) cache.dropCounts(gen, gone);
  return [...p.served.keys()];
}

/**
 * Send this isolate's pending deltas, take the current view (every page of key changes).
 * `lookup`: digests a waiting request presented that this isolate does not hold, looked
 * up in the same round trip.
 */
export async function sync(env, cfg, lookup = null) {
  const gen = cfg.activeGeneration;
  const asked = servedKeys(gen, Date.now(), cfg.servedKeepMs);
  const before = pending.get(gen);
  const flight = before ? { windows: before.windows, month: before.month, spend: before.spend } : null;
  let batch = takePending(gen);
  // Until the answer (which counts this batch) is in the cache, the limits still see the
  // batch's requests and tokens here: an isolate never forgets its own traffic.
  const sending = batch && keepSending(before, flight);
  let entry;
  try {
    for (let page = 0; page < MORE_PAGES_MAX; page++) {
      const info = infoOf(cfg, asked);
      if (lookup && page === 0) info.lookup = lookup;
      const t = now();
      const view = await activeStub(env, cfg).sync(info, batch);
      recordSync(gen, view, now() - t);
      batch = null;
      entry = cache.put(gen, view, Date.now(), asked);
      if (view.spent) spentByGen.set(gen, view.spent);
      if (sending) before.sending.delete(sending);
      if (view.found) cache.putLookup(gen, { rev: view.rev, ...view.found }, lookup, Date.now(), cfg.stateTtlMs);
      if (!view.more) break;
    }
  } catch (err) {
    if (sending) before.sending.delete(sending);
    restorePending(gen, batch);
    throw err;
  }
  return entry;
}

/** The counter maps a sync just took (those replaced by fresh ones), kept visible while it is in flight. */
function keepSending(p, flight) {
  const taken = { windows: p.windows !== flight.windows ? flight.windows : null, month: p.month !== flight.month ? flight.month : null,
    spend: p.spend !== flight.spend ? flight.spend : null };
  if (!taken.windows && !taken.month && !taken.spend) return null;
  p.sending.add(taken);
  return taken;
}

// --- key look-ups ---

const lookups = new Map(); // generation -> {waiting: Set of digests, busy, calls: [times]}

function lookupsOf(gen) {
  let l = lookups.get(gen);
  if (!l) {
    l = { waiting: new Set(), vouched: new Set(), busy: false, calls: [] };
    lookups.set(gen, l);
  }
  return l;
}

/** The digest of a presented key to look up with a stale view's sync, or null (held, known bad, or junk). */
export function wantedDigest(gen, digest) {
  const e = cache.entry(gen);
  if (e && e.keys && e.keys.has(digest)) return null;
  return cache.isKnownBad(gen, digest, Date.now()) ? null : digest;
}

/** ms until this isolate may make another look-up call (a burst of LOOKUP_BURST, then one per LOOKUP_EVERY_MS). */
function lookupDelay(l, t) {
  while (l.calls.length && t - l.calls[0] >= LOOKUP_EVERY_MS * LOOKUP_BURST) l.calls.shift();
  if (l.calls.length < LOOKUP_BURST) return 0;
  return Math.max(0, l.calls[l.calls.length - 1] + LOOKUP_EVERY_MS - t);
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

/**
 * The key record for a presented key's digest, or null. A digest this isolate neither
 * holds nor remembers as unknown is looked up: requests that arrive together share one
 * call (each waits by polling plain data, never on another request's promise), so a
 * flood of bad keys makes at most a few object calls a second. The wait is `state`.
 */
export async function findKey(env, cfg, entry, digest, timing, vouched = false) {
  const gen = cfg.activeGeneration;
  let rec = entry.keys ? entry.keys.get(digest) : undefined;
  if (rec) return rec;
  if (cache.isKnownBad(gen, digest, Date.now())) return null;
  const l = lookupsOf(gen);
  // A digest the key filter vouches for (keyfilter.js) is looked up first, queue full or not.
  if (!vouched && !l.waiting.has(digest) && l.waiting.size >= LOOKUP_WAITING_MAX) throw lookupBusy();
  l.waiting.add(digest);
  if (vouched) l.vouched.add(digest);
  const t = now();
  try {
    for (;;) {
      const e = cache.entry(gen);
      rec = e && e.keys ? e.keys.get(digest) : undefined;
      if (rec) return rec;
      if (cache.isKnownBad(gen, digest, Date.now())) return null;
      if (now() - t > LOOKUP_WAIT_MS) throw lookupBusy();
      const delay = l.busy ? 5 : lookupDelay(l, Date.now());
      if (delay > 0) {
        await sleep(Math.min(delay, 50));
        continue;
      }
      if (!l.waiting.has(digest)) {
        // A call that took it has not answered into the cache (no entry, or raced a drop): ask again.
        l.waiting.add(digest);
      }
      const found = await lookupCall(env, cfg, l, digest);
      if (found !== undefined) return found;
    }
  } finally {
    l.waiting.delete(digest);
    l.vouched.delete(digest);
    timing.state += now() - t;
  }
}

/** One look-up call for the waiting digests (ours first). undefined: look again in the cache. */
async function lookupCall(env, cfg, l, digest) {
  const gen = cfg.activeGeneration;
  l.waiting.delete(digest);
  const picked = new Set([digest]); // ours, then the vouched-for, then the rest in arrival order
  for (const from of [l.vouched, l.waiting]) {
    for (const d of from) {
      if (picked.size >= LOOKUP_BATCH) break;
      if (l.waiting.has(d)) picked.add(d);
    }
  }
  const digests = [...picked];
  for (const d of digests) l.waiting.delete(d);
  l.busy = true;
  l.calls.push(Date.now());
  try {
    const res = await activeStub(env, cfg).lookupKeys(digests, infoOf(cfg));
    const found = cache.putLookup(gen, res, digests, Date.now(), cfg.stateTtlMs);
    return found.get(digest) ?? null;
  } catch (err) {
    for (const d of digests.slice(1)) l.waiting.add(d); // the others retry on their own turn
    log(env, "state_unavailable", { generation: gen, error: String(err && err.message) });
    throw new HttpError(503, "state_unavailable", "the cell's state is unreachable; retry shortly", { "retry-after": "1" });
  } finally {
    l.busy = false;
  }
}

function lookupBusy() {
  return new HttpError(503, "key_lookup_busy", "this edge is checking many unknown API keys; retry shortly", { "retry-after": "1" });
}

// --- pending deltas ---
//
// A batch is an object of named parts; each part is an array of rows and has `has` (is
// anything pending), `take` (rows out, pending cleared) and `restore` (rows merged back
// when the sync failed). A new part (e.g. `hist`) is one entry in PARTS and one in
// pendingOf; the object applies it by name (generation.js `apply`).

const PARTS = {
  // The live view's histograms (histogram.js): per isolate, whatever the generation.
  hist: {
    has: () => false, // it rides on the syncs usage and refreshes make anyway: never a sync of its own
    take: () => takeHist(),
    restore: (p, rows) => recorder.restore(rows),
  },
  usage: {
    has: (p) => p.usage.size > 0,
    take: (p) => takeMap(p, "usage"),
    restore: (p, rows) => {
      for (const u of rows) {
        const deltas = {};
        for (let i = USAGE.requests; i < USAGE.length; i++) deltas[USAGE.names[i]] = u[i];
        addUsage(p, u[USAGE.day], u[USAGE.key_id], deltas);
      }
    },
  },
  windows: {
    has: (p) => p.windows.size > 0,
    take: (p) => takeMap(p, "windows"),
    restore: (p, rows) => {
      for (const w of rows) addWindow(p, w[WINDOW.key_id], w[WINDOW.minute], w[WINDOW.requests], w[WINDOW.tokens]);
    },
  },
  // What this isolate's fallback requests in flight may still cost, per key (spendcap.js): every
  // key with a reservation, and those that went to 0 since the last sync (a silent isolate's rows expire).
  fallback_held: {
    has: (p) => p.fbChanged.size > 0,
    take: (p) => {
      if (p.fbChanged.size === 0 && p.fbHeld.size === 0) return null; // every sync renews the rows in flight
      const rows = [];
      for (const id of new Set([...p.fbHeld.keys(), ...p.fbChanged])) rows.push([id, p.fbHeld.get(id) ?? 0]);
      p.fbChanged.clear();
      return rows;
    },
    restore: (p, rows) => { for (const r of rows) p.fbChanged.add(r[FALLBACK_HELD.key_id]); },
  },
  // Each key's 429s by reason (refusals.js): Prometheus' per-key counts (each day's total rides on `usage`).
  refusals: {
    has: (p) => p.refusals.size > 0,
    take: (p) => takeMap(p, "refusals"),
    restore: (p, rows) => { for (const r of rows) addRefusal(p, r[REFUSAL.key_id], r[REFUSAL.reason], r[REFUSAL.n]); },
  },
  // The scaling controller's signals (colocate/scaling/controller.py): requests and tokens by backend,
  // and this isolate's requests in flight per pod index (every pod, whenever one changed).
  backends: {
    has: (p) => p.backends.size > 0,
    take: (p) => takeMap(p, "backends"),
    restore: (p, rows) => {
      for (const r of rows) addBackend(p, r[BACKEND.backend], r[BACKEND.requests], r[BACKEND.prompt_tokens], r[BACKEND.completion_tokens]);
    },
  },
  pods: {
    has: (p) => p.podUrls !== null && inflightMoved(),
    take: (p) => (p.podUrls !== null && takeInflightMoved() ? p.podUrls.map((u, i) => [i, inflightOf(u)]) : null), // POD_INFLIGHT rows
    restore: () => takeInflightMoved(true),
  },
  inflight: {
    // Every key with requests in flight (or tokens reserved, or prompts not begun) here, and those that went to 0
    // since the last sync: the object's row of a silent isolate expires (2 x TTL), so a
    // live one renews it.
    has: (p) => p.inflightChanged.size > 0,
    take: (p) => {
      const rows = [];
      const row = (id) => inflightRow(id, p.inflight.get(id) ?? 0, p.reserved.get(id) ?? 0, p.prompt.get(id) ?? 0);
      for (const id of p.inflight.keys()) rows.push(row(id));
      for (const id of p.reserved.keys()) if (!p.inflight.has(id)) rows.push(row(id));
      for (const id of p.prompt.keys()) if (!p.inflight.has(id) && !p.reserved.has(id)) rows.push(row(id));
      for (const id of p.inflightChanged) if (!p.inflight.has(id) && !p.reserved.has(id) && !p.prompt.has(id)) rows.push(row(id));
      p.inflightChanged.clear();
      return rows.length ? rows : null;
    },
    restore: (p, rows) => { for (const r of rows) p.inflightChanged.add(r[INFLIGHT.key_id]); },
  },
};

function inflightRow(id, n, tokens, prompt) {
  const row = INFLIGHT.zero(id);
  row[INFLIGHT.n] = n;
  row[INFLIGHT.tokens] = tokens;
  row[INFLIGHT.prompt] = prompt;
  return row;
}

function takeMap(p, name) {
  if (p[name].size === 0) return null;
  const rows = [...p[name].values()];
  p[name] = new Map();
  if (name === "usage") {
    p.month = new Map();
    p.spend = new Map();
  }
  return rows;
}

function pendingOf(gen) {
  let p = pending.get(gen);
  if (!p) {
    p = { usage: new Map(), windows: new Map(), month: new Map(), spend: new Map(), inflight: new Map(), inflightChanged: new Set(), reserved: new Map(), prompt: new Map(),
      served: new Map(), plannedAt: -Infinity, sending: new Set(), backends: new Map(), podUrls: null, refusals: new Map(),
      fbHeld: new Map(), fbChanged: new Set(), fbHeldAll: 0 };
    pending.set(gen, p);
  }
  return p;
}

function takePending(gen) {
  const p = pending.get(gen);
  if (!p) return null;
  let batch = null;
  for (const name in PARTS) {
    const rows = PARTS[name].take(p);
    if (rows) (batch ??= {})[name] = rows;
  }
  return batch;
}

function restorePending(gen, batch) {
  if (!batch) return;
  const p = pendingOf(gen);
  for (const name in batch) if (PARTS[name]) PARTS[name].restore(p, batch[name]);
}

function hasPending(p) {
  for (const name in PARTS) if (PARTS[name].has(p)) return true;
  return false;
}

/** `deltas`: {column: n} of USAGE's counted columns (requests on). */
function addUsage(p, day, keyId, deltas) {
  const k = day + "|" + keyId;
  let row = p.usage.get(k);
  if (!row) {
    row = USAGE.zero(day, keyId);
    p.usage.set(k, row);
  }
  for (const name in deltas) row[USAGE[name]] += deltas[name];
  const cost = deltas.fallback_microusd ?? 0;
  if (cost > 0) {
    // this key's and the cell's ("|" alone) spend today, until a sync's answer holds it
    for (const s of [k, day + "|"]) p.spend.set(s, (p.spend.get(s) ?? 0) + cost);
  }
  const tokens = (deltas.prompt_tokens ?? 0) + (deltas.completion_tokens ?? 0);
  if (tokens > 0) {
    const m = day.slice(0, 7) + "|" + keyId;
    p.month.set(m, (p.month.get(m) ?? 0) + tokens);
  }
}

function addRefusal(p, keyId, reason, n) {
  const k = keyId + "|" + reason;
  let row = p.refusals.get(k);
  if (!row) {
    row = REFUSAL.zero(keyId, reason);
    p.refusals.set(k, row);
  }
  row[REFUSAL.n] += n;
}

/**
 * A key was refused a request (a 429) for `reason` (refusals.js REASONS) at `t`: counted in
 * its usage row of the day and by reason, carried by the next sync (never a sync of its own:
 * the caller plans the flush).
 */
export function refused(cfg, keyId, reason, t) {
  const p = pendingOf(cfg.activeGeneration);
  addUsage(p, dayOf(t), keyId, { refused: 1 });
  addRefusal(p, keyId, reason, 1);
}

function addBackend(p, backend, req, prompt, completion) {
  let row = p.backends.get(backend);
  if (!row) {
    row = BACKEND.zero(backend);
    p.backends.set(backend, row);
  }
  row[BACKEND.requests] += req;
  row[BACKEND.prompt_tokens] += prompt;
  row[BACKEND.completion_tokens] += completion;
}

function addWindow(p, keyId, minute, req, tok) {
  const k = keyId + "|" + minute;
  let row = p.windows.get(k);
  if (!row) {
    row = WINDOW.zero(keyId, minute);
    p.windows.set(k, row);
  }
  row[WINDOW.requests] += req;
  row[WINDOW.tokens] += tok;
}

/** (minute) => {req, tok} of this isolate's deltas for a key not yet in its view (pending or being sent). */
export function pendingCounter(gen, keyId) {
  const p = pending.get(gen);
  return (minute) => {
    const k = keyId + "|" + minute;
    const row = p && p.windows.get(k);
    const out = row ? { req: row[WINDOW.requests], tok: row[WINDOW.tokens] } : { req: 0, tok: 0 };
    if (p && p.sending.size) {
      for (const f of p.sending) {
        const r = f.windows && f.windows.get(k);
        if (r) {
          out.req += r[WINDOW.requests];
          out.tok += r[WINDOW.tokens];
        }
      }
    }
    return out;
  };
}

/** Tokens of a key this month not yet in this isolate's view (pending or being sent). */
export function pendingMonthTokens(gen, keyId, t) {
  const p = pending.get(gen);
  if (!p) return 0;
  const k = dayOf(t).slice(0, 7) + "|" + keyId;
  let n = p.month.get(k) ?? 0;
  for (const f of p.sending) if (f.month) n += f.month.get(k) ?? 0;
  return n;
}

const spentByGen = new Map(); // generation -> {day, microusd}: the cell's fallback spend as of the last sync

/**
 * What the fallback cost today (UTC day of `t`), in millionths of a dollar, as far as this
 * isolate knows: the key's (`keyId`) or, with null, the whole cell's, as of the last sync
 * plus this isolate's own since (pending or being sent).
 */
export function spentToday(gen, keyId, t) {
  const day = dayOf(t);
  let n = 0;
  if (keyId === null) {
    const s = spentByGen.get(gen);
    if (s && s.day === day) n += s.microusd;
  } else {
    const g = cache.count(gen, keyId);
    if (g && dayOf(g[COUNTER.minute] * 60_000) === day) n += g[COUNTER.day_fallback_microusd] ?? 0;
  }
  const p = pending.get(gen);
  if (!p) return n;
  const k = day + "|" + (keyId ?? "");
  n += p.spend.get(k) ?? 0;
  for (const f of p.sending) if (f.spend) n += f.spend.get(k) ?? 0;
  return n;
}

/**
 * What fallback requests in flight may still cost (millionths of a dollar): the key's, or
 * with null the whole cell's, here now plus the other isolates' as of the last sync.
 */
export function fallbackReserved(gen, keyId) {
  const p = pending.get(gen);
  let n = p ? (keyId === null ? p.fbHeldAll : p.fbHeld.get(keyId) ?? 0) : 0;
  if (keyId === null) {
    const s = spentByGen.get(gen);
    n += (s && s.reserved) || 0;
  } else {
    const g = cache.count(gen, keyId);
    n += (g && g[COUNTER.fallback_reserved]) || 0;
  }
  return n;
}

/** Requests of a key in flight in this isolate now. */
export function inflightHere(gen, keyId) {
  const p = pending.get(gen);
  return p ? p.inflight.get(keyId) ?? 0 : 0;
}

/** Prompt tokens of a key's requests in flight here that no pod has begun answering yet. */
export function promptHere(gen, keyId) {
  const p = pending.get(gen);
  return p ? p.prompt.get(keyId) ?? 0 : 0;
}

/** Tokens this isolate's requests in flight of a key reserved at admission (not yet settled). */
export function reservedHere(gen, keyId) {
  const p = pending.get(gen);
  return p ? p.reserved.get(keyId) ?? 0 : 0;
}

/**
 * A key's max_parallel slot, taken before its request's body is read (the key is known
 * from the header), so one key's uploads in flight are bounded by its own limit: the
 * release (idempotent) frees it; `admit` takes it over. A key without max_parallel: null.
 */
export function hold(cfg, key) {
  if (!(key.max_parallel > 0)) return null;
  const p = pendingOf(cfg.activeGeneration);
  p.inflight.set(key.id, (p.inflight.get(key.id) ?? 0) + 1);
  p.inflightChanged.add(key.id);
  let held = true;
  return () => {
    if (!held) return;
    held = false;
    const n = (p.inflight.get(key.id) ?? 1) - 1;
    if (n > 0) p.inflight.set(key.id, n);
    else p.inflight.delete(key.id);
    p.inflightChanged.add(key.id);
  };
}

/**
 * A request was admitted for a key: it counts against the limits at once, and its
 * counters are asked for from now on. A key with max_parallel holds a slot (`held`, from
 * `hold`, or one taken here), a key with tpm or monthly_tokens holds `reserve` tokens (what
 * the request may cost at most), and `prompt` tokens (its prompt at most, for
 * max_parallel_tokens) are held until its answer begins at a pod. `release` (returned;
 * idempotent) frees all it holds, in the same turn as its usage is recorded (`served`), so
 * the limits see the reservation, then the real usage, never neither; `release.begun` frees
 * the prompt tokens alone, when the pod's first token arrives; `release.fallback(microusd)`
 * adds, when the fallback is about to be called, the most its answer may cost (spendcap.js)
 * against the key's and the cell's daily caps, here at once and in the other isolates from
 * the next sync, freed with the rest. One reservation per request, whatever it holds.
 */
export function admit(cfg, key, t, reserve = 0, prompt = 0, held = null) {
  const p = pendingOf(cfg.activeGeneration);
  p.podUrls = cfg.podUrls; // the indexes the `pods` part reports in-flight counts by
  p.served.set(key.id, t);
  addWindow(p, key.id, minuteOf(t), 1, 0);
  addUsage(p, dayOf(t), key.id, { requests: 1 });
  const slot = held === null && key.max_parallel > 0;
  const tokens = reserve > 0 && (key.tpm > 0 || key.monthly_tokens > 0) ? reserve : 0;
  if (slot) p.inflight.set(key.id, (p.inflight.get(key.id) ?? 0) + 1);
  if (tokens > 0) p.reserved.set(key.id, (p.reserved.get(key.id) ?? 0) + tokens);
  if (prompt > 0) p.prompt.set(key.id, (p.prompt.get(key.id) ?? 0) + prompt);
  if (slot || tokens > 0 || prompt > 0) p.inflightChanged.add(key.id);
  let waiting = prompt > 0;
  const begun = () => {
    if (!waiting) return;
    waiting = false;
    const r = (p.prompt.get(key.id) ?? prompt) - prompt;
    if (r > 0) p.prompt.set(key.id, r);
    else p.prompt.delete(key.id);
    p.inflightChanged.add(key.id);
  };
  let open = true;
  let spend = 0; // the fallback's worst case, held
  const release = () => {
    if (!open) return;
    open = false;
    begun();
    if (held !== null) held();
    if (slot) {
      const n = (p.inflight.get(key.id) ?? 1) - 1;
      if (n > 0) p.inflight.set(key.id, n);
      else p.inflight.delete(key.id);
    }
    if (tokens > 0) {
      const r = (p.reserved.get(key.id) ?? tokens) - tokens;
      if (r > 0) p.reserved.set(key.id, r);
      else p.reserved.delete(key.id);
    }
    if (slot || tokens > 0) p.inflightChanged.add(key.id);
    if (spend > 0) {
      const r = (p.fbHeld.get(key.id) ?? spend) - spend;
      if (r > 0) p.fbHeld.set(key.id, r);
      else p.fbHeld.delete(key.id);
      p.fbHeldAll = Math.max(0, p.fbHeldAll - spend);
      p.fbChanged.add(key.id);
    }
  };
  release.begun = begun;
  release.fallback = (/** @type {number} */ microusd) => {
    if (!open || !(microusd > 0)) return;
    spend += microusd;
    p.fbHeld.set(key.id, (p.fbHeld.get(key.id) ?? 0) + microusd);
    p.fbHeldAll += microusd;
    p.fbChanged.add(key.id);
  };
  return release;
}

/**
 * A request admitted at `t` was not served here: a fleet's front door asked for "no pod"
 * and sends it to another cell, which counts it. Its request is taken back out of this
 * cell's counters (the bucket and day it was added to), so the fleet counts it once.
 */
export function withdraw(cfg, keyId, t) {
  const p = pendingOf(cfg.activeGeneration);
  addWindow(p, keyId, minuteOf(t), -1, 0);
  addUsage(p, dayOf(t), keyId, { requests: -1 });
  addBackend(p, "none", 1, 0, 0); // still demand on this cell: the scaling signal counts it
}

/**
 * A request finished: who served it and its usage ({prompt, completion, estimated?} or
 * null); estimated usage (counted from streamed text) is also added to estimated_tokens. A
 * fallback answer costs its tokens at `price` (its model's, colocate:fallbackModels, else FALLBACK_PRICE).
 */
export function served(cfg, keyId, t, backend, usage, price = cfg.fallbackSpend.price) {
  const p = pendingOf(cfg.activeGeneration);
  const prompt = usage ? usage.prompt : 0;
  const completion = usage ? usage.completion : 0;
  const estimated = usage && usage.estimated ? prompt + completion : 0;
  const fallback = backend === "fallback" ? 1 : 0;
  // $ per 1M tokens is millionths of a dollar per token
  const cost = fallback && price ? Math.ceil(prompt * price.input + completion * price.output) : 0;
  addUsage(p, dayOf(t), keyId, { prompt_tokens: prompt, completion_tokens: completion, pod_requests: 1 - fallback,
    fallback_requests: fallback, estimated_tokens: estimated, fallback_microusd: cost });
  addBackend(p, backend, 1, prompt, completion);
  if (prompt + completion > 0) addWindow(p, keyId, minuteOf(t), 0, prompt + completion);
}

let soonAt = -Infinity; // the last syncSoon of this isolate

/**
 * A sync now, in the background (at most one each SOON_MS per isolate): for a key admitted on
 * its floor share, whose lease this isolate does not hold (router.js), so the lease arrives in
 * one round trip rather than with the next flush.
 */
export function syncSoon(env, ctx, cfg) {
  const t = Date.now();
  if (t - soonAt < SOON_MS) return;
  soonAt = t;
  ctx.waitUntil(sync(env, cfg).catch(syncFailed(env, cfg.activeGeneration)));
}
const SOON_MS = 100;

/** A catch handler that logs a failed sync of `gen` (its batch is back in pending: sync). */
export function syncFailed(env, gen, extra = {}) {
  return (err) => log(env, "sync_failed", { generation: gen, error: String(err && err.message), ...extra });
}

/** Make sure the pending deltas reach the object soon, without delaying any response. */
export function scheduleFlush(env, ctx, cfg) {
  const gen = cfg.activeGeneration;
  const p = pendingOf(gen);
  const delay = Math.min(FLUSH_MAX_MS, Math.floor(cfg.stateTtlMs / 2));
  const t = Date.now();
  if (t - p.plannedAt < delay + 5000) return; // one planned flush per isolate at a time
  p.plannedAt = t;
  ctx.waitUntil(flush(env, cfg, p, delay).catch(syncFailed(env, gen)));
}

/**
 * The planned flush, `delay` after the request that planned it. A failed sync puts its batch
 * back (sync), and is tried again FLUSH_RETRIES times, 1, 2 then 4 retry periods later: an
 * isolate that gets no further request (a cell its front door no longer sends to) would
 * otherwise keep its usage and histograms until one comes. All within the request's
 * waitUntil (Cloudflare's 30 s after the response).
 */
async function flush(env, cfg, p, delay) {
  await sleep(delay);
  for (let attempt = 0; ; attempt++) {
    p.plannedAt = -Infinity; // a request from now on plans its own flush: this one may have taken its rows already
    if (!hasPending(p)) return;
    try {
      await sync(env, cfg);
    } catch (err) {
      syncFailed(env, cfg.activeGeneration, { attempt })(err);
      if (attempt >= FLUSH_RETRIES) return;
      p.plannedAt = Date.now(); // this flush is still planned: requests meanwhile leave their rows to it
      await sleep(Math.max(delay, FLUSH_RETRY_MIN_MS) * 2 ** attempt);
      continue;
    }
    await learnObjectColo(env, cfg)?.catch(syncFailed(env, cfg.activeGeneration));
    return;
  }
}

// --- where the object answers from (the live view's `sync` segment) ---

const objectColos = new Map(); // generation -> {colo, askedAt}

/** One sync round trip, keyed by the colo the object reported (or this isolate learnt). */
function recordSync(gen, view, ms) {
  const o = objectColos.get(gen);
  if (view.colo) objectColos.set(gen, { colo: view.colo, askedAt: o ? o.askedAt : 0 });
  recorder.sync(Date.now(), view.colo || (o && o.colo) || null, null, ms);
}

/**
 * The object reports its colo only once something asked it (`colo()`: the probe after a
 * deploy; a sync makes no outside request). An isolate whose views carry none asks once,
 * in the background after a flush, so every later view of that object carries it.
 */
function learnObjectColo(env, cfg) {
  const gen = cfg.activeGeneration;
  const o = objectColos.get(gen);
  const t = Date.now();
  if ((o && o.colo) || (o && t - o.askedAt < 60_000)) return null;
  objectColos.set(gen, { colo: null, askedAt: t });
  return activeStub(env, cfg).colo().then((c) => {
    if (c) objectColos.set(gen, { colo: c, askedAt: t });
  });
}

// --- the breaker ---

/** Ask the object for a pod's half-open trial slot (a wait, counted in `state`). */
export async function requestTrial(env, cfg, podUrl) {
  const res = await activeStub(env, cfg).tryTrial(podUrl, infoOf(cfg));
  cache.put(cfg.activeGeneration, res.view, Date.now());
  return res.granted;
}

/**
 * Tell the object how a pod did, without delaying the response. `from`: whose request it
 * was ({key} or, for a failed health check, {key: null, health: true}): the object opens a
 * breaker only on failures from two keys or a health check (machine.js). When the object
 * answers that the streak waits for a witness, `witness(podUrl)` (a health check) runs in
 * the same background task. Returns that task's promise.
 */
/**
 * One pace verdict on an answer of `podUrl` (`slow` or not; machine.js recordPace), in the
 * background; the answer's view is cached, so a pod marked slow is passed over at once.
 */
export function reportPace(env, ctx, cfg, podUrl, slow, from = null) {
  const gen = cfg.activeGeneration;
  const task = Promise.resolve()
    .then(() => activeStub(env, cfg).reportPace(podUrl, slow, infoOf(cfg), from))
    .then((res) => {
      if (res.marked) log(env, "pod_slow", { generation: gen, pod: new URL(podUrl).host });
      cache.put(gen, res.view, Date.now());
    })
    .catch((err) => log(env, "report_failed", { generation: gen, error: String(err && err.message) }));
  ctx.waitUntil(task);
  return task;
}

export function report(env, ctx, cfg, podUrl, ok, from = null, witness = null) {
  const gen = cfg.activeGeneration;
  const task = Promise.resolve()
    .then(() => activeStub(env, cfg).report(podUrl, ok, infoOf(cfg), from))
    .then((res) => {
      if (res.to !== res.from) log(env, "breaker", { generation: gen, pod: new URL(podUrl).host, from: res.from, to: res.to });
      cache.put(gen, res.view, Date.now());
      if (res.witness && witness && healthDue(podUrl, Date.now())) return witness(podUrl);
      return null;
    })
    .catch((err) => log(env, "report_failed", { generation: gen, error: String(err && err.message) }));
  ctx.waitUntil(task);
  return task;
}
