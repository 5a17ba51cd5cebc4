// The Worker's side of the generation object: which object, the cached view, the
// batched deltas (usage and limit counters), and breaker reports.
//
// One mechanism keeps the isolate and the object in step: `sync` sends this isolate's
// pending deltas and receives the current view in the same round trip. It runs
//   - in the background from half the TTL on (refresh-ahead, never a wait),
//   - at most FLUSH_MAX_MS after a request recorded usage (ctx.waitUntil timer),
//   - in the foreground only when the view is stale (cold/idle isolate, STATE_TTL_MS = 0)
//     or, rate-limited per isolate, when an unknown key might be one created moments ago.
// Every call passes `info` (generation names, the machine's numbers, the keys revision
// held) so the object needs no bindings of its own beyond BREAKER (read-through).

import { log } from "./errors.js";
import { ViewCache } from "./cache.js";
import { dayOf, minuteOf } from "./limits.js";
import { healthDue } from "./pods.js";
import { now } from "./timing.js";
import { recorder, takeHist } from "./histogram.js";

export const cache = new ViewCache(); // module scope: lives as long as the isolate
const ids = new Map(); // generation -> DurableObjectId (plain data, safe to keep)
const pending = new Map(); // generation -> {usage: Map, windows: Map, plannedAt}

const FLUSH_MAX_MS = 1000; // usage reaches the object at most this long after a request
const MISS_INTERVAL_MS = 250; // at most one foreground sync per isolate this often for unknown keys

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

export function infoOf(cfg) {
  return {
    generation: cfg.activeGeneration,
    draining: cfg.drainingGeneration,
    drainingHint: cfg.drainingHint,
    failureThreshold: cfg.failureThreshold,
    openMs: cfg.openMs,
    deadlineMs: cfg.deadlineMs,
    haveRev: cache.rev(cfg.activeGeneration),
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
    ctx.waitUntil(sync(env, cfg).catch((err) => log(env, "sync_failed", { generation: gen, error: String(err && err.message) })));
  }
  return cache.entry(gen);
}

/**
 * The cache entry a request routes on, and how long it waited for it (ms). Fresh:
 * no wait, no I/O. Half-way to stale: no wait, sync in the background.
 */
export async function currentView(env, ctx, cfg) {
  const entry = freshEntry(env, ctx, cfg);
  if (entry !== null) return { entry, wait: 0 };
  const gen = cfg.activeGeneration;
  const t = now();
  try {
    return { entry: await sync(env, cfg), wait: now() - t };
  } catch (err) {
    // The object is unreachable: route on what we last knew (or nothing: closed, no keys)
    // rather than fail every request.
    log(env, "state_unavailable", { generation: gen, error: String(err && err.message) });
    return { entry: cache.entry(gen) ?? cache.put(gen, EMPTY_VIEW, -Infinity), wait: now() - t };
  }
}

/** Send this isolate's pending deltas, take the current view. */
export async function sync(env, cfg) {
  const gen = cfg.activeGeneration;
  const batch = takePending(gen);
  try {
    const t = now();
    const view = await activeStub(env, cfg).sync(infoOf(cfg), batch);
    recorder.sync(Date.now(), view.colo, null, now() - t); // the live view's `sync`, keyed by where the object answered
    return cache.put(gen, view, Date.now());
  } catch (err) {
    restorePending(gen, batch);
    throw err;
  }
}

/**
 * The key record for a presented key's digest, or null. An unknown digest with a fresh
 * view costs no object call; once per MISS_INTERVAL_MS an isolate re-syncs to find a key
 * created elsewhere moments ago (that wait is counted in `state`), and remembers digests
 * that are still unknown, so a flood of bad keys makes at most a few calls a second.
 */
export async function findKey(env, cfg, entry, digest, timing) {
  const gen = cfg.activeGeneration;
  let e = entry;
  let rec = e.keys ? e.keys.get(digest) : undefined;
  if (rec) return rec;
  const t0 = Date.now();
  if (cache.isKnownBad(gen, digest, t0) || (e.keys && t0 - e.missAt < MISS_INTERVAL_MS)) return null;
  e.missAt = t0;
  const t = now();
  try {
    e = await sync(env, cfg);
  } catch (err) {
    log(env, "state_unavailable", { generation: gen, error: String(err && err.message) });
    return null;
  } finally {
    timing.state += now() - t;
  }
  e.missAt = t0;
  rec = e.keys ? e.keys.get(digest) : undefined;
  if (rec) return rec;
  cache.forget(gen, digest, Date.now(), cfg.stateTtlMs);
  return null;
}

// --- pending deltas ---

function pendingOf(gen) {
  let p = pending.get(gen);
  if (!p) {
    p = { usage: new Map(), windows: new Map(), plannedAt: -Infinity };
    pending.set(gen, p);
  }
  return p;
}

function takePending(gen) {
  const p = pending.get(gen);
  if (!p || (p.usage.size === 0 && p.windows.size === 0)) return null;
  const batch = { usage: [...p.usage.values()], windows: [...p.windows.values()] };
  // The histograms ride on batches that carry usage: every routed request makes one.
  const hist = takeHist();
  if (hist) batch.hist = hist;
  p.usage = new Map();
  p.windows = new Map();
  return batch;
}

function restorePending(gen, batch) {
  if (!batch) return;
  if (batch.hist) recorder.restore(batch.hist);
  const p = pendingOf(gen);
  for (const u of batch.usage) addUsage(p, u[0], u[1], u.slice(2));
  for (const w of batch.windows) addWindow(p, w[0], w[1], w[2], w[3]);
}

function addUsage(p, day, keyId, deltas) {
  const k = day + "|" + keyId;
  let row = p.usage.get(k);
  if (!row) {
    row = [day, keyId, 0, 0, 0, 0, 0];
    p.usage.set(k, row);
  }
  for (let i = 0; i < 5; i++) row[2 + i] += deltas[i];
}

function addWindow(p, keyId, minute, req, tok) {
  const k = keyId + "|" + minute;
  let row = p.windows.get(k);
  if (!row) {
    row = [keyId, minute, 0, 0];
    p.windows.set(k, row);
  }
  row[2] += req;
  row[3] += tok;
}

/** (minute) => {req, tok} of this isolate's unsynced deltas for a key. */
export function pendingCounter(gen, keyId) {
  const p = pending.get(gen);
  return (minute) => {
    const row = p && p.windows.get(keyId + "|" + minute);
    return row ? { req: row[2], tok: row[3] } : { req: 0, tok: 0 };
  };
}

/** Tokens this isolate has not synced yet for a key in the current month. */
export function pendingMonthTokens(gen, keyId, t) {
  const p = pending.get(gen);
  if (!p) return 0;
  const month = dayOf(t).slice(0, 8);
  let n = 0;
  for (const row of p.usage.values()) if (row[1] === keyId && row[0].startsWith(month)) n += row[3] + row[4];
  return n;
}

/** A request was admitted for a key: it counts against the limits at once. */
export function admit(cfg, keyId, t) {
  const p = pendingOf(cfg.activeGeneration);
  addWindow(p, keyId, minuteOf(t), 1, 0);
  addUsage(p, dayOf(t), keyId, [1, 0, 0, 0, 0]);
}

/** A request finished: who served it and the tokens its answer reported (0 if none). */
export function served(cfg, keyId, t, backend, usage) {
  const p = pendingOf(cfg.activeGeneration);
  const prompt = usage ? usage.prompt : 0;
  const completion = usage ? usage.completion : 0;
  addUsage(p, dayOf(t), keyId, [0, prompt, completion, backend === "fallback" ? 0 : 1, backend === "fallback" ? 1 : 0]);
  if (prompt + completion > 0) addWindow(p, keyId, minuteOf(t), 0, prompt + completion);
}

/** Make sure the pending deltas reach the object soon, without delaying any response. */
export function scheduleFlush(env, ctx, cfg) {
  const gen = cfg.activeGeneration;
  const p = pendingOf(gen);
  const delay = Math.min(FLUSH_MAX_MS, Math.floor(cfg.stateTtlMs / 2));
  const t = Date.now();
  if (t - p.plannedAt < delay + 5000) return; // one planned flush per isolate at a time
  p.plannedAt = t;
  const wait = delay > 0 ? new Promise((resolve) => setTimeout(resolve, delay)) : Promise.resolve();
  ctx.waitUntil(wait
    .then(() => {
      p.plannedAt = -Infinity;
      if (p.usage.size || p.windows.size) return sync(env, cfg);
      return null;
    })
    .catch((err) => log(env, "sync_failed", { generation: gen, error: String(err && err.message) })));
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
