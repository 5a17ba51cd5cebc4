// @ts-check
// Live segment histograms: relative-error log buckets (DDSketch's idea on OpenTelemetry's
// exponential grid at scale 5), counted in memory on the hot path and carried to the
// generation object by the isolate's sync (`batch.hist`), no I/O of their own.
//
// Buckets (the same in every isolate, the object, colocate/probe/live.py and the Prometheus
// exposition): bucket 0 holds [0, 0.25 ms] (a request that waited on nothing measures exactly
// 0 in workerd); bucket k = 1..TOP holds (EDGES[k-1], EDGES[k]] with EDGES[k] = 0.25 ms x
// 2^(k/32), up to TOP, the first edge past 60 s; bucket TOP + 1 holds everything above it.
// Upper edges are inclusive, as Prometheus' `le`. A bucket stands for 2 lo hi / (lo + hi),
// which is within (2^(1/32) - 1) / (2^(1/32) + 1) = 1.08 % of every value in it, so every
// quantile between 0.25 ms and 60 s is within 1.08 % (below 0.25 ms: within 0.25 ms).
// Counts add bucket by bucket, so isolates, minutes, hours and cells merge exactly.
//
// A histogram travels and is stored as text: "~" and then, for each non-empty bucket in
// order, its index's gap from the previous one (the first: the index itself) and "*count"
// when the count is not 1, the gap left out when it is 1 and the count is not ("~0*118,200,
// 3*40,*7": 118 in bucket 0, 1 in 200, 40 in 203, 7 in 204). Text
// without the "~" is the earlier fixed-bucket form ("index:count,..." over 41 buckets, each
// edge 1.374x the last), still read: decode spreads each old bucket evenly over the new
// buckets it covers, as the old percentile did.

import { HIST } from "./payloads.js";
import { fetchColo } from "./trace.js";

export const LOW_MS = 0.25;
export const HIGH_MS = 60000;
export const PER_OCTAVE = 32; // OpenTelemetry scale 5
/** The last bounded bucket: its upper edge is the first at or past HIGH_MS (60.03 s). */
export const TOP = Math.ceil(Math.log2(HIGH_MS / LOW_MS) * PER_OCTAVE);
export const BUCKETS = TOP + 2;
/** EDGES[k] is the (inclusive) upper edge of bucket k, k = 0..TOP; bucket TOP + 1 has none. */
export const EDGES = Float64Array.from({ length: TOP + 1 }, (_, k) => LOW_MS * 2 ** (k / PER_OCTAVE));
/** REPS[k]: the value bucket k stands for (2 lo hi / (lo + hi); 0 for bucket 0, EDGES[TOP] above). */
export const REPS = Float64Array.from({ length: BUCKETS }, (_, k) => {
  if (k === 0) return 0;
  if (k > TOP) return EDGES[TOP];
  return (2 * EDGES[k - 1] * EDGES[k]) / (EDGES[k - 1] + EDGES[k]);
});
/** The worst relative error of a value in a bounded bucket: 1.08 %. */
export const RELATIVE_ERROR = (2 ** (1 / PER_OCTAVE) - 1) / (2 ** (1 / PER_OCTAVE) + 1);

/** The routed segments, in Server-Timing order; `sync` is the isolate's own round trip. */
export const ROUTED = Object.freeze(["state", "upstream", "fallback", "total"]);
export const SYNC = "sync";
/**
 * A streamed answer's segments, recorded when it ends: `ttft` (the request's start to the
 * upstream's first byte, as the Worker saw it) and `itl` (the mean gap between its tokens).
 * `affinity` and `shed` count requests only (each a 0 in bucket 0): a prefix-affinity pick sent
 * to the point's own pod, and one shed by the load bound (docs/worker.md, "Prefix affinity").
 */
export const STREAMED = Object.freeze(["ttft", "itl"]);
export const PICKS = Object.freeze(["affinity", "shed"]);
/**
 * `queue`: a pod request's wait from its dispatch to the pod's first token (its prompt's
 * place in the pod's queue and its prefill; a whole short answer's end; a deadline miss at
 * the deadline): where one key's long prompts show (docs/worker.md, "Busy is not broken").
 */
export const QUEUED = Object.freeze(["queue"]);
/**
 * `cut` counts streams only (each a 0 in bucket 0): a stream whose pod broke off or stalled after
 * its first token, ended with an error event (router.js; a preempted pod's streams end so).
 */
export const CUTS = Object.freeze(["cut"]);
/** Every segment a request's row may carry, in the recorder's layout. */
export const LIVE = Object.freeze([...ROUTED, ...STREAMED, ...PICKS, ...QUEUED, ...CUTS]);
const AT = Object.fromEntries(LIVE.map((s, i) => [s, i * BUCKETS]));
const MINUTE_MS = 60000;
const MAX_MINUTES = 180; // unsynced minutes an isolate keeps (the object unreachable for hours: oldest dropped)
// Labels (pod, or pod@client colo) one minute holds per isolate: every pod of a cell from
// every Cloudflare colo a front door runs in fits (about 330 colos, 2026-12); more are folded.
export const MAX_LABELS = 512;

/** The bucket of a duration in ms (NaN and negatives count as 0). */
export function bucketOf(ms) {
  if (!(ms > LOW_MS)) return 0;
  if (ms > EDGES[TOP]) return TOP + 1;
  let k = Math.ceil(Math.log2(ms / LOW_MS) * PER_OCTAVE);
  // the logarithm may land one off at an edge: settle it against the edges themselves
  if (ms > EDGES[k]) k++;
  else if (ms <= EDGES[k - 1]) k--;
  return k;
}

/** (low, high] of bucket k in ms; bucket 0 is [0, 0.25], the last (60.03 s, Infinity). */
export function bounds(k) {
  if (k <= 0) return [0, EDGES[0]];
  if (k > TOP) return [EDGES[TOP], Infinity];
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
 * the probe's exact percentiles), each rank's value its bucket's REPS: within 1.08 % of the
 * exact percentile of the same values (0.25 ms below 0.25 ms).
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
    before += counts[k];
    if (i < before) return REPS[k];
  }
  return REPS[BUCKETS - 1];
}

// The texts of small numbers, made once: making them for every part was a fifth of encode's time.
const NUMBER_TEXT = Array.from({ length: 1024 }, (_, i) => String(i));
const numberText = (n) => (n < 1024 ? NUMBER_TEXT[n] : String(n));

/** The text of the non-empty buckets of counts[offset .. offset + BUCKETS) ("" when none). */
export function encode(counts, offset = 0) {
  let s = "";
  let prev = 0;
  for (let k = 0; k < BUCKETS; k++) {
    const c = counts[offset + k];
    if (c === 0) continue;
    const gap = s && k - prev === 1 && c > 1 ? "" : numberText(k - prev); // a run of buckets: "*c" each
    s += (s ? "," : "~") + gap + (c === 1 ? "" : "*" + numberText(c));
    prev = k;
  }
  return s;
}

/** The histogram of a text (either form); a malformed part throws a TypeError naming it. */
export function decode(text, into = empty()) {
  if (typeof text !== "string") throw new TypeError(`histogram must be text "~gap*count,...", got ${typeof text}`);
  if (text === "") return into;
  if (text[0] !== "~") return decodeFixed(text, into);
  return decodeDigits(text, into) ? into : decodeParts(text, into);
}

// decodeDigits's parts, before any is added (a text it cannot read adds nothing)
const PART_K = new Uint16Array(2 * BUCKETS);
const PART_C = new Float64Array(2 * BUCKETS);

/**
 * `decodeParts` for a text of digits, stars and commas only, as `encode` writes, read by hand
 * (a split and a regex per part took 7 times as long). False, with `into` untouched,
 * for anything else: `decodeParts` reads it (or throws) as always.
 */
function decodeDigits(text, into) {
  const len = text.length;
  let i = 1;
  let k = 0;
  let n = 0;
  for (;;) {
    let gap = 0;
    let gapDigits = 0;
    for (let ch = text.charCodeAt(i); i < len && ch >= 48 && ch <= 57; ch = text.charCodeAt(++i)) {
      gap = gap * 10 + ch - 48;
      gapDigits++;
    }
    let c = 1;
    if (i < len && text.charCodeAt(i) === 42) { // "*"
      i++;
      c = 0;
      let countDigits = 0;
      for (let ch = text.charCodeAt(i); i < len && ch >= 48 && ch <= 57; ch = text.charCodeAt(++i)) {
        c = c * 10 + ch - 48;
        countDigits++;
      }
      if (countDigits === 0 || countDigits > 15 || c < 1) return false;
      if (gapDigits === 0) {
        if (n === 0) return false;
        k++;
      } else if (gapDigits > 4) return false;
      else k += gap;
    } else if (gapDigits === 0 || gapDigits > 4) return false;
    else k += gap;
    if (k >= BUCKETS || n === PART_K.length) return false;
    PART_K[n] = k;
    PART_C[n++] = c;
    if (i === len) break;
    if (text.charCodeAt(i) !== 44) return false; // ","
    i++;
  }
  for (let j = 0; j < n; j++) into[PART_K[j]] += PART_C[j];
  return true;
}

/** The "~gap*count,..." text part by part; a malformed part throws a TypeError naming it. */
export function decodeParts(text, into = empty()) {
  let k = 0;
  let first = true;
  for (const part of text.slice(1).split(",")) {
    const star = part.indexOf("*");
    const gap = star < 0 ? part : part.slice(0, star);
    const c = star < 0 ? 1 : Number(part.slice(star + 1));
    if (gap === "" && star === 0 && !first) k++;
    else k += /^\d{1,4}$/.test(gap) ? Number(gap) : NaN;
    first = false;
    if (!(k < BUCKETS) || !Number.isSafeInteger(c) || c < 1) {
      throw new TypeError(`bad histogram part ${JSON.stringify(part)}: expected gap[*count] with buckets 0..${BUCKETS - 1}`);
    }
    into[k] += c;
  }
  return into;
}

// --- the earlier fixed buckets, read only (stored minutes and isolates of the previous version) ---

const FIXED_STEPS = 39;
const FIXED_RATIO = Math.log(HIGH_MS / LOW_MS) / FIXED_STEPS;
/** The earlier scheme's upper edges: 0.25 ms x 1.374^k, k = 0..39 (the last is 60 s). */
export const FIXED_EDGES = Object.freeze(Array.from({ length: FIXED_STEPS + 1 },
  (_, k) => (k === FIXED_STEPS ? HIGH_MS : LOW_MS * Math.exp(k * FIXED_RATIO))));

/**
 * "index:count,..." over the 41 fixed buckets into the new ones: bucket 0 stays 0, the
 * overflow goes above 60 s, and bucket k's count is spread evenly over [EDGES[k-1], EDGES[k]),
 * the j-th of c values at (j + 0.5)/c of the way (where the old percentile put it), counted
 * per new bucket without visiting each value.
 */
function decodeFixed(text, into) {
  for (const part of text.split(",")) {
    const i = part.indexOf(":");
    const k = Number(part.slice(0, i));
    const c = Number(part.slice(i + 1));
    if (i < 1 || !Number.isInteger(k) || k < 0 || k > FIXED_STEPS + 1 || !Number.isSafeInteger(c) || c < 0) {
      throw new TypeError(`bad histogram part ${JSON.stringify(part)}: expected index:count with index 0..${FIXED_STEPS + 1}`);
    }
    if (c === 0) continue;
    if (k === 0) into[0] += c;
    else if (k > FIXED_STEPS) into[TOP + 1] += c;
    else {
      const lo = FIXED_EDGES[k - 1];
      const width = FIXED_EDGES[k] - lo;
      // values j with lo + width (j + 0.5)/c <= e, i.e. j <= c (e - lo)/width - 0.5
      const upTo = (e) => Math.min(c, Math.max(0, Math.floor((c * (e - lo)) / width - 0.5) + 1));
      let done = 0;
      for (let b = bucketOf(lo + width / (2 * c)); done < c; b++) {
        const n = b > TOP ? c : upTo(EDGES[b]);
        into[b] += n - done;
        done = n;
      }
    }
  }
  return into;
}

const MERGED = empty();
/** Sum two texts (either form) into one in the current form. */
export function mergeEncoded(a, b) {
  MERGED.fill(0); // synchronous: no other merge runs between the fill and the encode
  return encode(decode(b, decode(a, MERGED)));
}

/**
 * One isolate's unsynced histograms, per minute:
 *   requests  per pod ("0", "1", ..., "fallback", each "@<client colo>" behind a fleet's front
 *             door): the four routed segments. The colo is the isolate's own (one isolate
 *             runs in one colo), filled in when they are taken, so a request never waits for
 *             the isolate to learn where it runs.
 *   syncs     per (the object's colo, the Worker's colo): the isolate's sync round trips.
 * `take` turns them into `batch.hist` rows (payloads.js HIST: at, colo, who, segment, hist)
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

  /**
   * The counts of `pod` this minute (LIVE.length histograms end to end), `pod` being
   * "<pod>@<client colo>" behind a front door. Past MAX_LABELS a minute, a new label is
   * counted under its pod alone, so no caller can grow the rows without bound.
   */
  of(t, pod) {
    const req = this.slot(t).req;
    let counts = req.get(pod);
    if (counts === undefined && req.size >= MAX_LABELS) {
      const at = pod.indexOf("@");
      if (at >= 0) return this.of(t, pod.slice(0, at));
    }
    if (counts === undefined) {
      counts = new Uint32Array(LIVE.length * BUCKETS);
      req.set(pod, counts);
    }
    return counts;
  }

  /** One value of a LIVE segment (a stream's ttft or itl in ms; an affinity or shed pick: 0). */
  one(t, pod, segment, ms) {
    this.of(t, pod)[AT[segment] + bucketOf(ms)]++;
  }

  /** A routed request's segments ({state, upstream, fallback, total} in ms), served by `pod`. */
  request(t, pod, timing) {
    const counts = this.of(t, pod);
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
        for (let i = 0; i < LIVE.length; i++) {
          const enc = encode(counts, i * BUCKETS);
          if (enc) rows.push(HIST.of({ at: minute, colo: where, who: pod, segment: LIVE[i], hist: enc }));
        }
      }
      for (const [k, counts] of s.sync) {
        const bar = k.indexOf("|");
        rows.push(HIST.of({ at: minute, colo: k.slice(0, bar), who: k.slice(bar + 1) || where, segment: SYNC, hist: encode(counts) }));
      }
    }
    this.minutes = new Map();
    this.curMinute = -1;
    this.cur = null;
    return rows;
  }

  /** Put back rows a failed sync did not deliver (they are added to what came since). */
  restore(rows) {
    for (const r of rows || []) {
      const [minute, colo, who, segment, enc] = [r[HIST.at], r[HIST.colo], r[HIST.who], r[HIST.segment], r[HIST.hist]];
      const s = this.slot(minute * MINUTE_MS);
      if (segment === SYNC) {
        const k = colo + "|" + who;
        s.sync.set(k, decode(enc, s.sync.get(k) || empty()));
      } else {
        const i = LIVE.indexOf(segment);
        if (i < 0) continue;
        let counts = s.req.get(who);
        if (counts === undefined) {
          counts = new Uint32Array(LIVE.length * BUCKETS);
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

const CLIENT_COLO = /^[A-Z]{3}$/;

/**
 * A routed request's segments, served by `backend` ("pod-<i>" or "fallback"; "none", a front
 * door's deferral that another cell serves and records, is left out). With `timing.client`
 * (a fleet's front door said where the client was) the row's `who` is "<pod>@<colo>".
 */
export function recordRequest(backend, timing) {
  if (backend === "none") return;
  recorder.request(Date.now(), whoOf(backend, timing.client), timing);
}

/** The recorder's `who` of a backend ("pod-<i>" or "fallback"), with the client's colo behind a front door. */
function whoOf(backend, client) {
  const pod = backend === "fallback" ? backend : backend.slice(4);
  return client && CLIENT_COLO.test(client) ? pod + "@" + client : pod;
}

/**
 * A streamed answer's end: `ttftMs` from the request's start to its first byte from upstream,
 * and its completion tokens over the time since, as the mean gap between tokens (none for one token).
 */
export function recordStream(backend, client, ttftMs, afterFirstMs, tokens) {
  const t = Date.now();
  const who = whoOf(backend, client);
  recorder.one(t, who, "ttft", ttftMs);
  if (tokens > 1) recorder.one(t, who, "itl", afterFirstMs / (tokens - 1));
}

/** A pod request's wait for its first token, `ms` (`backend` "pod-<i>"; a negative wait is not recorded). */
export function recordQueue(backend, client, ms) {
  if (ms >= 0) recorder.one(Date.now(), whoOf(backend, client), "queue", ms);
}

/** A stream of `backend` ("pod-<i>") cut after its first token (its pod broke off or stalled). */
export function recordCut(backend, client) {
  recorder.one(Date.now(), whoOf(backend, client), "cut", 0);
}

/** A prefix-affinity pick for pod `index`: to the point's own pod, or shed by the load bound. */
export function recordPick(index, shed, client) {
  recorder.one(Date.now(), whoOf("pod-" + index, client), shed ? "shed" : "affinity", 0);
}
