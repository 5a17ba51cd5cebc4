// Live segment histograms: fixed log-spaced buckets, counted in memory on the hot path and
// carried to the generation object by the isolate's sync (`batch.hist`), no I/O of their own.
//
// Buckets (the same in every isolate, the object and colocate/probe/live.py, which reads the
// edges from GET /_colocate/live): bucket 0 holds [0, 0.25 ms) (a request that waited on
// nothing measures exactly 0 in workerd), buckets 1..39 are log-spaced from 0.25 ms to 60 s
// (each edge 1.374x the previous, so a percentile is known to within ~37 %, one bucket),
// bucket 40 holds everything from 60 s on. A histogram travels and is stored as text,
// "index:count" for each non-empty bucket, comma-separated ("0:118,21:2,22:40"): a segment of
// one minute is a few dozen bytes.

import { fetchColo } from "./trace.js";

export const LOW_MS = 0.25;
export const HIGH_MS = 60000;
const STEPS = 39;
const LOG_RATIO = Math.log(HIGH_MS / LOW_MS) / STEPS;
/** EDGES[k] is the upper edge of bucket k (k = 0..39); bucket 40 has no upper edge. */
export const EDGES = Object.freeze(Array.from({ length: STEPS + 1 }, (_, k) => (k === STEPS ? HIGH_MS : LOW_MS * Math.exp(k * LOG_RATIO))));
export const BUCKETS = EDGES.length + 1;

/** The routed segments, in Server-Timing order; `sync` is the isolate's own round trip. */
export const ROUTED = Object.freeze(["state", "upstream", "fallback", "total"]);
export const SYNC = "sync";
const MINUTE_MS = 60000;
const MAX_MINUTES = 180; // unsynced minutes an isolate keeps (the object unreachable for hours: oldest dropped)

/** The bucket of a duration in ms (NaN and negatives count as 0). */
export function bucketOf(ms) {
  if (!(ms >= LOW_MS)) return 0;
  if (ms >= HIGH_MS) return BUCKETS - 1;
  let k = Math.floor(Math.log(ms / LOW_MS) / LOG_RATIO) + 1;
  // the logarithm may land one off at an edge: settle it against the edges themselves
  if (k > 1 && ms < EDGES[k - 1]) k--;
  else if (k < BUCKETS - 1 && ms >= EDGES[k]) k++;
  return k;
}

/** [low, high) of bucket k in ms; the last bucket is [60 s, 60 s]. */
export function bounds(k) {
  if (k <= 0) return [0, EDGES[0]];
  if (k >= BUCKETS - 1) return [HIGH_MS, HIGH_MS];
  return [EDGES[k - 1], EDGES[k]];
}

export function empty() {
  return new Uint32Array(BUCKETS);
}

/** Add `ms` to a histogram (a Uint32Array of BUCKETS, or a slice of a larger one at `offset`). */
export function add(counts, ms, offset = 0) {
  counts[offset + bucketOf(ms)]++;
}

/** counts += other (both BUCKETS long). */
export function merge(counts, other) {
  for (let k = 0; k < BUCKETS; k++) counts[k] += other[k];
  return counts;
}

export function total(counts) {
  let n = 0;
  for (let k = 0; k < BUCKETS; k++) n += counts[k];
  return n;
}

/**
 * The q-th percentile (0..100) of a histogram, or null when it is empty. Ranks as numpy's
 * default (position q/100 x (n - 1), interpolated between the two neighbouring ranks, like
 * the probe's exact percentiles); the j-th of a bucket's c values is placed at (j + 0.5)/c
 * of the way between its edges, so the answer is within one bucket's width of the exact
 * one. Bucket 0 holds 0s, the overflow bucket 60 s.
 */
export function percentile(counts, q) {
  const n = total(counts);
  if (n === 0) return null;
  const pos = (Math.min(100, Math.max(0, q)) / 100) * (n - 1);
  const lo = Math.floor(pos);
  const a = valueAt(counts, lo);
  return lo === pos ? a : a + (valueAt(counts, lo + 1) - a) * (pos - lo);
}

/** The estimated value of the i-th smallest (0-based) of the histogram's values. */
function valueAt(counts, i) {
  let before = 0;
  for (let k = 0; k < BUCKETS; k++) {
    const c = counts[k];
    if (c === 0) continue;
    if (i < before + c) {
      if (k === 0) return 0;
      if (k === BUCKETS - 1) return HIGH_MS;
      const [lo, hi] = bounds(k);
      return lo + ((hi - lo) * (i - before + 0.5)) / c;
    }
    before += c;
  }
  return HIGH_MS;
}

/** "index:count,..." of the non-empty buckets of counts[offset .. offset + BUCKETS). */
export function encode(counts, offset = 0) {
  let s = "";
  for (let k = 0; k < BUCKETS; k++) {
    const c = counts[offset + k];
    if (c) s += (s ? "," : "") + k + ":" + c;
  }
  return s;
}

/** The histogram of an encoded text; a malformed part throws a TypeError naming it. */
export function decode(text, into = empty()) {
  if (typeof text !== "string") throw new TypeError(`histogram must be text "index:count,...", got ${typeof text}`);
  if (text === "") return into;
  for (const part of text.split(",")) {
    const i = part.indexOf(":");
    const k = Number(part.slice(0, i));
    const c = Number(part.slice(i + 1));
    if (i < 1 || !Number.isInteger(k) || k < 0 || k >= BUCKETS || !Number.isSafeInteger(c) || c < 0) {
      throw new TypeError(`bad histogram part ${JSON.stringify(part)}: expected index:count with index 0..${BUCKETS - 1}`);
    }
    into[k] += c;
  }
  return into;
}

/** Sum two encoded histograms. */
export function mergeEncoded(a, b) {
  return encode(decode(b, decode(a)));
}

/**
 * One isolate's unsynced histograms, per minute:
 *   requests  per pod ("0", "1", ..., "fallback"): the four routed segments. The colo is the
 *             isolate's own (one isolate runs in one colo), filled in when they are taken,
 *             so a request never waits for the isolate to learn where it runs.
 *   syncs     per (the object's colo, the Worker's colo): the isolate's sync round trips.
 * `take` turns them into `batch.hist` rows [minute, colo, who, segment, "index:count,..."]
 * where `who` is the pod for the routed segments and the Worker's colo for `sync`.
 */
export class Recorder {
  constructor() {
    this.minutes = new Map(); // minute -> {req: Map(pod -> Uint32Array(4 x BUCKETS)), sync: Map("colo|from" -> Uint32Array)}
    this.curMinute = -1;
    this.cur = null;
  }

  slot(t) {
    const m = Math.floor(t / MINUTE_MS);
    if (m === this.curMinute) return this.cur;
    let s = this.minutes.get(m);
    if (!s) {
      s = { req: new Map(), sync: new Map() };
      this.minutes.set(m, s);
      if (this.minutes.size > MAX_MINUTES) this.minutes.delete(Math.min(...this.minutes.keys()));
    }
    this.curMinute = m;
    this.cur = s;
    return s;
  }

  /** A routed request's segments ({state, upstream, fallback, total} in ms), served by `pod`. */
  request(t, pod, timing) {
    const req = this.slot(t).req;
    let counts = req.get(pod);
    if (counts === undefined) {
      counts = new Uint32Array(ROUTED.length * BUCKETS);
      req.set(pod, counts);
    }
    counts[bucketOf(timing.state)]++;
    counts[BUCKETS + bucketOf(timing.upstream)]++;
    counts[2 * BUCKETS + bucketOf(timing.fallback)]++;
    counts[3 * BUCKETS + bucketOf(timing.total)]++;
  }

  /** One sync round trip of `ms`, answered by an object in `colo`, from a Worker in `from` (null: here). */
  sync(t, colo, from, ms) {
    const sync = this.slot(t).sync;
    const k = (colo || "unknown") + "|" + (from || ""); // "": this isolate's colo, filled in by take
    let counts = sync.get(k);
    if (counts === undefined) {
      counts = empty();
      sync.set(k, counts);
    }
    counts[bucketOf(ms)]++;
  }

  get size() {
    return this.minutes.size;
  }

  /** Everything recorded, as batch.hist rows, and forget it. `colo` is where this isolate runs. */
  take(colo) {
    const rows = [];
    const where = colo || "unknown";
    for (const [minute, s] of this.minutes) {
      for (const [pod, counts] of s.req) {
        for (let i = 0; i < ROUTED.length; i++) {
          const enc = encode(counts, i * BUCKETS);
          if (enc) rows.push([minute, where, pod, ROUTED[i], enc]);
        }
      }
      for (const [k, counts] of s.sync) {
        const bar = k.indexOf("|");
        rows.push([minute, k.slice(0, bar), k.slice(bar + 1) || where, SYNC, encode(counts)]);
      }
    }
    this.minutes = new Map();
    this.curMinute = -1;
    this.cur = null;
    return rows;
  }

  /** Put back rows a failed sync did not deliver (they are added to what came since). */
  restore(rows) {
    for (const [minute, colo, who, segment, enc] of rows || []) {
      const s = this.slot(minute * MINUTE_MS);
      if (segment === SYNC) {
        const k = colo + "|" + who;
        s.sync.set(k, decode(enc, s.sync.get(k) || empty()));
      } else {
        const i = ROUTED.indexOf(segment);
        if (i < 0) continue;
        let counts = s.req.get(who);
        if (counts === undefined) {
          counts = new Uint32Array(ROUTED.length * BUCKETS);
          s.req.set(who, counts);
        }
        const h = decode(enc);
        for (let k = 0; k < BUCKETS; k++) counts[i * BUCKETS + k] += h[k];
      }
    }
    this.curMinute = -1; // slot() above moved it
    this.cur = null;
  }
}

// --- this isolate's recorder and colo (module scope: they live as long as the isolate) ---

export const recorder = new Recorder();
const here = { asked: false, settled: false, colo: null, cf: null };

/**
 * Learn once, in the background, which colo this isolate runs in: its own /cdn-cgi/trace
 * (what the probe trusts; request.cf.colo may name the accepting colo under placement, and
 * is used only when the trace cannot be fetched). Never awaited by a request.
 */
export function learnColo(ctx, request, fetchImpl) {
  if (here.asked) return;
  here.asked = true;
  const cf = request && request.cf && typeof request.cf.colo === "string" ? request.cf.colo.toUpperCase() : null;
  here.cf = cf;
  ctx.waitUntil(fetchColo(fetchImpl).then((c) => {
    here.colo = c;
    here.settled = true;
  }, () => {
    here.settled = true;
  }));
}

/** This isolate's colo once learnt ("unknown" when neither the trace nor cf said), else undefined. */
export function isolateColo() {
  return here.settled ? here.colo ?? here.cf ?? "unknown" : undefined;
}

/** batch.hist: everything recorded so far, or null (nothing, or the colo is still being learnt). */
export function takeHist() {
  if (recorder.size === 0) return null;
  const colo = isolateColo();
  if (colo === undefined) return null; // a moment later: every row of this isolate carries its colo
  const rows = recorder.take(colo);
  return rows.length ? rows : null;
}

/** A routed request's segments, served by `backend` ("pod-<i>" or "fallback"). */
export function recordRequest(backend, timing) {
  recorder.request(Date.now(), backend === "fallback" ? backend : backend.slice(4), timing);
}
