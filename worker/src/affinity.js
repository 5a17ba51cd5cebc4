// @ts-check
// Prefix affinity: a conversation's next turn goes to the pod that already holds its prefix
// in vLLM's prefix cache, with no look-up and no shared state (docs/worker.md, "Prefix
// affinity"). Pure: every isolate computes the same answer from the same request.
//
// The point of a request is a hash of its key's id (the salt, as the pod's `cache_salt` keeps
// each key's cache apart) and the part of its prompt that every later turn of the same
// conversation repeats: the messages up to and including the first user message (the app's
// system prompt and the conversation's opening), at most HEAD characters of each. A client's
// OpenAI `prompt_cache_key` names the conversation outright and is hashed instead.
//
// The pods are ordered for that point by rendezvous (highest random weight) hashing: each pod's
// score is a mix of the point and the pod's URL, highest first. It is consistent hashing without
// a ring: a pod leaving rotation moves only the points it won (each to its own second choice),
// and each pod wins an equal share in expectation, where a ring of 4 pods needs hundreds of
// virtual nodes to come within a few percent (and costs a binary search). With the few pods of a
// cell, n multiplications per request cost less than the search.
//
// Bounded loads (Mirrokni, Thorup and Zadimoghaddam, SODA 2018): a pod takes the request only
// while its load, the request included, is at most ceil(c x the candidates' mean load, the
// request included); otherwise the request goes to the next pod in its order. No pod exceeds
// c x the mean, and a pod near its bound sheds only the excess, each shed point to its own
// next pod, so the shed load spreads too. The bound is never below MIN_CAP requests: at light
// load a pod's batch has room, and its cache is worth more than evenness (with one isolate's
// few requests in flight, ceil(c x mean) alone would shed at 2).

export const DEFAULT_BOUND = 1.5; // c: 1.25 shed 14 % of turns with about 5 requests a pod in a simulation of 200 conversations, 1.5 shed 5 %
export const MIN_CAP = 4;
const HEAD = 2048; // characters of each leading text hashed: enough to tell conversations apart
const MAX_LEADING = 16; // messages looked at before the first user message (system, developer, tools)

const FNV_OFFSET = 0x811c9dc5;
const FNV_PRIME = 0x01000193;

/** FNV-1a over the UTF-16 code units of at most `max` characters of `s`, continuing from `h`. */
function fnv(h, s, max) {
  const n = s.length < max ? s.length : max;
  for (let i = 0; i < n; i++) h = Math.imul(h ^ s.charCodeAt(i), FNV_PRIME);
  // the length too, so that "ab" + "c" and "a" + "bc" differ
  return Math.imul(h ^ n, FNV_PRIME);
}

/** MurmurHash3's finaliser: every bit of the input moves every bit of the output. */
export function mix(h) {
  h ^= h >>> 16;
  h = Math.imul(h, 0x85ebca6b);
  h ^= h >>> 13;
  h = Math.imul(h, 0xc2b2ae35);
  h ^= h >>> 16;
  return h >>> 0;
}

/** A message's text: a string, or the text parts of a parts array (images and audio by their URL's head). */
function content(h, c) {
  if (typeof c === "string") return fnv(h, c, HEAD);
  if (!Array.isArray(c)) return h;
  let left = HEAD;
  for (let i = 0; i < c.length && left > 0; i++) {
    const p = c[i];
    if (!p || typeof p !== "object") continue;
    const t = typeof p.text === "string" ? p.text : p.image_url && typeof p.image_url.url === "string" ? p.image_url.url : null;
    if (t === null) continue;
    h = fnv(h, t, left);
    left -= t.length;
  }
  return h;
}

/**
 * The request's point: the key's id and the conversation's stable prefix (above), a 32-bit
 * unsigned integer. `json` is the parsed body (null for GET /v1/models: the salt alone).
 * @param {string} salt  the key's id
 * @param {any} json
 */
export function prefixHash(salt, json) {
  let h = fnv(FNV_OFFSET, salt, 64);
  if (json === null || typeof json !== "object") return mix(h);
  if (typeof json.prompt_cache_key === "string" && json.prompt_cache_key !== "") return mix(fnv(h ^ 1, json.prompt_cache_key, HEAD));
  const msgs = json.messages;
  if (Array.isArray(msgs)) {
    for (let i = 0; i < msgs.length && i <= MAX_LEADING; i++) {
      const m = msgs[i];
      if (!m || typeof m !== "object") continue;
      const role = typeof m.role === "string" ? m.role : "";
      h = content(fnv(h, role, 16), m.content);
      if (role === "user") break; // the conversation's opening: every later turn starts with it
    }
    return mix(h);
  }
  const p = json.prompt;
  // A legacy completion's prompt grows turn by turn: its head is the stable part.
  if (typeof p === "string") return mix(fnv(h ^ 2, p, HEAD));
  if (Array.isArray(p) && p.length) {
    if (typeof p[0] === "string") return mix(fnv(h ^ 2, p[0], HEAD));
    for (let i = 0; i < p.length && i < HEAD / 4; i++) h = Math.imul(h ^ (Number(p[i]) | 0), FNV_PRIME);
  }
  return mix(h);
}

/** Each URL's seed, computed once per pod list (an isolate routes to one list). */
let seeded = { urls: /** @type {readonly string[] | null} */ (null), seeds: new Uint32Array(0) };

function seedsOf(urls) {
  if (seeded.urls !== urls) {
    const seeds = new Uint32Array(urls.length);
    for (let i = 0; i < urls.length; i++) seeds[i] = mix(fnv(FNV_OFFSET, urls[i], 1024));
    seeded = { urls, seeds };
  }
  return seeded.seeds;
}

/** Pod i's score for point h (rendezvous hashing): a URL's, so a pod keeps its points whatever its index. */
export function score(seed, h) {
  return mix((h ^ seed) + 0x9e3779b9);
}

/** The most a candidate may hold, this request included: `total` is the candidates' load with it. */
export function capOf(total, k, bound = DEFAULT_BOUND) {
  const cap = Math.ceil((bound * total) / k);
  return cap > MIN_CAP ? cap : MIN_CAP;
}

/** The picks so far, and how the last went: by affinity (the point's own pod), or shed to another by load. */
export const counts = { affinity: 0, shed: 0, lastShed: false };

/**
 * The pod for a request (a policy: urls, candidate indexes, loads, the request's point):
 * the candidates in the point's rendezvous order, the first whose load (`loads[i]`, requests in
 * flight or what the pod reports) stays within the bound with this request; -1 when there are
 * no candidates. `bound` is c (> 1). When every candidate is at its bound (possible only with
 * fractional loads), the least loaded takes it.
 * @param {readonly string[]} urls
 * @param {readonly number[]} indexes
 * @param {ArrayLike<number>} loads
 * @param {number} h  prefixHash(...) of the request
 * @param {number} [bound]
 */
export function pickPrefix(urls, indexes, loads, h, bound = DEFAULT_BOUND) {
  const k = indexes.length;
  if (k === 0) return -1;
  const seeds = seedsOf(urls);
  let total = 1; // this request
  for (let j = 0; j < k; j++) total += loads[indexes[j]] || 0;
  const cap = capOf(total, k, bound);
  // The candidates best first, without sorting: take the best not yet refused, k times at most.
  let refused = 0; // bit j: candidate j is over its bound (a cell has at most 32 candidates here)
  let least = -1;
  for (let round = 0; round < k && round < 32; round++) {
    let best = -1;
    let bestScore = -1;
    for (let j = 0; j < k && j < 32; j++) {
      if (refused & (1 << j)) continue;
      const s = score(seeds[indexes[j]], h);
      if (s > bestScore) {
        bestScore = s;
        best = j;
      }
    }
    const i = indexes[best];
    const load = loads[i] || 0;
    if (load + 1 <= cap) {
      if (round === 0) counts.affinity++;
      else counts.shed++;
      counts.lastShed = round > 0;
      return i;
    }
    if (least < 0 || load < (loads[least] || 0)) least = i;
    refused |= 1 << best;
  }
  counts.shed++;
  counts.lastShed = true;
  return least;
}

const scratch = { loads: new Float64Array(16) };

/**
 * The `prefix` balancing policy in pods.js's interface (urls, indexes, loads, info) -> index:
 * a candidate's load is the cell's requests in flight there (this isolate's now, the others' as
 * of their sync), or what the pod reports running and waiting when that is more; `info` is the
 * request ({keyId, json}) and may carry `prefixBound` (c; colocate:worker.prefixBound).
 * @param {readonly string[]} urls
 * @param {readonly number[]} indexes
 * @param {{here(i: number, urls: readonly string[]): number, others(i: number): number,
 *   pod?(i: number, urls: readonly string[]): {running: number, waiting: number} | null}} loads
 * @param {{keyId: string, json: any, prefixBound?: number}} info
 */
export function prefixPolicy(urls, indexes, loads, info) {
  if (scratch.loads.length < urls.length) scratch.loads = new Float64Array(urls.length);
  const l = scratch.loads;
  for (const i of indexes) {
    const cell = loads.here(i, urls) + loads.others(i);
    const p = loads.pod ? loads.pod(i, urls) : null;
    l[i] = p !== null && p.running + p.waiting > cell ? p.running + p.waiting : cell;
  }
  return pickPrefix(urls, indexes, l, prefixHash(info.keyId, info.json), info.prefixBound ?? DEFAULT_BOUND);
}

/** The candidates in the point's order, best first (tests, and the fleet's front door). */
export function order(names, indexes, h) {
  const seeds = seedsOf(names);
  return [...indexes].sort((a, b) => score(seeds[b], h) - score(seeds[a], h));
}
