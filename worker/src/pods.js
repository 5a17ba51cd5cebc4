// @ts-check
// Which pod serves a request: the breaker's verdict per pod, pods marked slow passed over
// while another is not, then a balancing policy (colocate:worker.balance) over what the
// isolate knows of each pod's load. Pure but for the in-flight counters and the pods'
// last reported metrics, which are plain values in module scope.

import { CLOSED, route } from "./machine.js";
import { prefixPolicy } from "./affinity.js";

const inflight = new Map(); // pod URL -> requests this isolate has in flight there
let podsMoved = false; // a count changed since the sync last took them (state.js `pods` part)

const CLOSED_POD = Object.freeze({ state: CLOSED, failures: 0, opened_at: null, trial_at: null });

/** The breaker snapshot of one pod, with the cell-wide override (machine.js shape). */
export function podSnap(view, url) {
  return { ...(view.pods[url] || CLOSED_POD), forced: view.forced };
}

/** Whether the object needs to hear about this outcome (a clean closed pod writes nothing). */
export function worthReporting(view, url, ok) {
  return !ok || url in view.pods;
}

/**
 * The pods a request may use, in the order to try them: {pods: [index...] routed to
 * directly, trials: [index...] whose half-open slot may be asked for}. `exclude` is a
 * set of indexes already tried.
 */
export function candidates(urls, view, now, cfg, exclude) {
  // The common case: no pod has a breaker row and no override, so every pod is routable.
  if (view.forced === null && (!exclude || exclude.size === 0) && isEmpty(view.pods)) return { pods: allOf(urls), trials: NONE };
  const pods = [];
  const trials = [];
  for (let i = 0; i < urls.length; i++) {
    if (exclude && exclude.has(i)) continue;
    const r = route(podSnap(view, urls[i]), now, cfg);
    if (r === "pod") pods.push(i);
    else if (r === "trial") trials.push(i);
  }
  return { pods, trials };
}

const NONE = Object.freeze([]);
let all = { urls: null, indexes: NONE }; // [0..n-1] for the one pod list an isolate routes to

function allOf(urls) {
  if (all.urls !== urls) all = { urls, indexes: Object.freeze(urls.map((_, i) => i)) };
  return all.indexes;
}

function isEmpty(o) {
  for (const _ in o) return false;
  return true;
}

// --- balancing policies ---
//
// A policy is a function (urls, indexes, loads, info) -> index (-1: none), as sglang's
// sgl-router keeps one per file under policies/:
//   urls     the pods' base URLs (index = pod index, POD_URLS);
//   indexes  the candidate indexes, in order: breaker closed (or a trial granted), and not
//            marked slow while another candidate is not;
//   loads    what is known of each pod's load, by index: loads.here(i) this isolate's
//            requests in flight there, loads.others(i) the other isolates' as of their last
//            sync (the generation object sums them), loads.pod(i) what the pod last said in
//            its /metrics ({running, waiting, kv}, kv in 0..1; null when unknown or older
//            than METRICS_FRESH_MS);
//   info     the request: {keyId, path, json} (json null for GET /v1/models).
// A policy must be synchronous and cheap: it runs on the hot path, which waits on nothing.
// affinity.js plugs its prefix-affinity policy in here (POLICIES).

/** least_busy: the fewest requests in flight in this isolate; ties at random (the policy before 2026-12). */
export function leastBusy(urls, indexes, loads = LOADS) {
  let best = -1;
  let bestLoad = Infinity;
  let ties = 0;
  for (const i of indexes) {
    const load = loads.here(i, urls);
    if (load < bestLoad) {
      best = i;
      bestLoad = load;
      ties = 1;
    } else if (load === bestLoad && Math.random() * ++ties < 1) {
      best = i; // reservoir choice: each tied pod equally likely
    }
  }
  return best;
}

// A pod whose KV cache is this full makes new sequences wait (or preempts running ones):
// it is passed over while another pod is below it, as the Gateway API Inference
// Extension's endpoint picker filters on KV-cache use before it scores.
export const KV_FULL = 0.9;

/**
 * load (the default): the pod with the least work queued for it. Its load is the larger of
 * what the cell has in flight there (this isolate now + the others as of their sync) and
 * what the pod reports running + waiting (which also counts requests the cell's counts do
 * not see yet), plus its waiting requests once more, since a waiting request's time to
 * first token is the queue's whole length; pods at KV_FULL or more go last. Ties at random.
 */
export function leastLoaded(urls, indexes, loads = LOADS) {
  let best = -1;
  let bestScore = Infinity;
  let ties = 0;
  for (const i of indexes) {
    const cell = loads.here(i, urls) + loads.others(i);
    const p = loads.pod(i, urls);
    let score = cell;
    if (p !== null) {
      score = Math.max(cell, p.running + p.waiting) + p.waiting;
      if (p.kv >= KV_FULL) score += 1e6;
    }
    if (score < bestScore) {
      best = i;
      bestScore = score;
      ties = 1;
    } else if (score === bestScore && Math.random() * ++ties < 1) {
      best = i;
    }
  }
  return best;
}

/** random: any candidate, each equally likely (a baseline for bench/prefix.py). */
function anyOf(_urls, indexes) {
  return indexes.length ? indexes[Math.floor(Math.random() * indexes.length)] : -1;
}

/** The policies by their colocate:worker.balance name (BALANCE binding); prefix: affinity.js. */
export const POLICIES = Object.freeze({ load: leastLoaded, least_busy: leastBusy, prefix: prefixPolicy, random: anyOf });
export const DEFAULT_POLICY = "load";

/** The loads of a view (its `others`, from the generation object) for a policy. */
/** @returns {Loads} */
export function loadsOf(view) {
  const others = view.others;
  return others === undefined ? LOADS : { here, others: (i) => others[i] || 0, pod: podMetrics };
}

/** @typedef {{here(i: number, urls: readonly string[]): number, others(i: number): number,
 *   pod(i: number, urls: readonly string[]): {running: number, waiting: number, kv: number} | null}} Loads */

const here = (i, urls) => inflight.get(urls[i]) || 0;
/** @type {Loads} */
const LOADS = Object.freeze({ here, others: (_i) => 0, pod: podMetrics });

/**
 * The candidates a policy chooses among: `indexes` without the pods the view marks slow
 * (pace, machine.js), unless every one of them is.
 */
export function unhurried(urls, indexes, view, now) {
  const slow = view.slow;
  if (slow === undefined) return indexes;
  const fast = indexes.filter((i) => !(slow[urls[i]] > now));
  return fast.length ? fast : indexes;
}

// --- what the pods report (vLLM's /metrics), scraped off the hot path ---

export const METRICS_EVERY_MS = 1000; // at most one scrape per pod per isolate this often
export const METRICS_FRESH_MS = 5000; // an older report is not used
const METRICS_MISSING_MS = 60_000; // a pod without /metrics is asked again this much later
const metrics = new Map(); // pod URL -> {running, waiting, kv, at} | {missing: true, at}
const scrapedAt = new Map(); // pod URL -> when this isolate last asked

function podMetrics(i, urls) {
  const m = metrics.get(urls[i]);
  return m === undefined || m.missing || Date.now() - m.at > METRICS_FRESH_MS ? null : m;
}

/** Whether the pod's /metrics may be asked now (and, if so, that it is being asked). */
export function metricsDue(url, now) {
  const last = scrapedAt.get(url);
  const m = metrics.get(url);
  const every = m !== undefined && m.missing ? METRICS_MISSING_MS : METRICS_EVERY_MS;
  if (last !== undefined && now - last < every) return false;
  scrapedAt.set(url, now);
  return true;
}

/** Record a pod's /metrics text (null: it has none, or did not answer). */
export function putMetrics(url, text, now) {
  const m = text === null ? null : parseMetrics(text);
  metrics.set(url, m === null ? { missing: true, at: now } : { ...m, at: now });
}

/** The metrics a pod last reported (tests, the probe). */
export function metricsOf(url) {
  return metrics.get(url) ?? null;
}

// vLLM's gauges (docs.vllm.ai, "Production Metrics"); kv_cache_usage_perc was
// gpu_cache_usage_perc before v0.10. Summed over label sets (one per engine).
const GAUGES = { "vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting",
  "vllm:kv_cache_usage_perc": "kv", "vllm:gpu_cache_usage_perc": "kv" };

/** {running, waiting, kv} from Prometheus text, or null when it has none of vLLM's gauges. */
export function parseMetrics(text) {
  const out = { running: 0, waiting: 0, kv: 0 };
  let found = false;
  for (const line of text.split("\n")) {
    if (!line.startsWith("vllm:")) continue;
    const brace = line.indexOf("{");
    const space = line.indexOf(" ");
    const name = line.slice(0, brace >= 0 && brace < space ? brace : space);
    const field = GAUGES[name];
    if (field === undefined) continue;
    const v = Number(line.slice(line.lastIndexOf("}") + 1 || space).trim().split(" ")[0]);
    if (!Number.isFinite(v) || v < 0) continue;
    out[field] = field === "kv" ? Math.max(out.kv, Math.min(1, v)) : out[field] + v;
    found = true;
  }
  return found ? out : null;
}

// --- pace (machine.js recordPace) ---

// An answer is judged by its pace only past this many tokens a choice: a shorter one says
// more about its prompt's prefill and the step it landed in than about the pod's rate.
export const PACE_MIN_TOKENS = 32;

/**
 * "slow", "ok" or null (too short to judge) for a stream read at `pace` (forward.js Pace):
 * its tokens a choice after the first (one event per token per choice, as vLLM streams)
 * over the time the router waited for them, against `minTokensPerS`.
 */
export function paceVerdict(pace, n, minTokensPerS) {
  const tokens = (pace.events - 1) / Math.max(1, n);
  if (tokens < PACE_MIN_TOKENS) return null;
  return tokens * 1000 < minTokensPerS * Math.max(1, pace.waitMs) ? "slow" : "ok";
}

export function started(url) {
  inflight.set(url, (inflight.get(url) || 0) + 1);
  podsMoved = true;
}

export function finished(url) {
  const n = (inflight.get(url) || 1) - 1;
  if (n <= 0) inflight.delete(url);
  else inflight.set(url, n);
  podsMoved = true;
}

/** Whether an in-flight count changed since the sync last took them. */
export function inflightMoved() {
  return podsMoved;
}

/** The same, and the sync takes them now (`undo`: a failed sync gives them back). */
export function takeInflightMoved(undo = false) {
  const moved = podsMoved;
  podsMoved = undo;
  return moved;
}

/** In-flight counts by URL (tests and the probe). */
export function inflightOf(url) {
  return inflight.get(url) || 0;
}

// --- whose failure (docs/worker.md, "Whose failure") ---

/**
 * Whose fault a request's pod failures were, once the fallback answered it with `status`
 * (null: the fallback was unreachable): "pod" (report them, with the request's key) or
 * "request" (report none). A request that failed on two pods, or that the fallback
 * refused (4xx) or failed on (5xx) as well, carries its own fault. The fallback's own
 * trouble (unreachable, 401, 403, 408, 429) says nothing about the request.
 */
export function blameOf(failedPods, status) {
  if (failedPods >= 2) return "request";
  if (status === null || status < 400 || status === 401 || status === 403 || status === 408 || status === 429) return "pod";
  return "request";
}

const HEALTH_EVERY_MS = 1000; // at most one health check per pod per isolate this often
const healthAt = new Map(); // pod URL -> when this isolate last checked it
const healthSaid = new Map(); // pod URL -> what the last check said (true: answered)

/** Whether a health check of `url` may run now (and, if so, that it is running). */
export function healthDue(url, now) {
  const last = healthAt.get(url);
  if (last !== undefined && now - last < HEALTH_EVERY_MS) return false;
  healthAt.set(url, now);
  return true;
}

/** A health check of `url` answered (`ok`) or not. */
export function healthSeen(url, ok) {
  healthSaid.set(url, ok);
}

/** What the last health check of `url` said (undefined: none yet). */
export function lastHealth(url) {
  return healthSaid.get(url);
}

// --- the pods' queues as this isolate sees them (busy.js) ---

const unbegun = new Map(); // pod URL -> this isolate's requests sent there, their first token not yet arrived

/** This isolate's requests at `url` still waiting for their first token. */
export function waitingAt(url) {
  return unbegun.get(url) || 0;
}

/** A request is sent to `url`: how many of this isolate's requests wait there ahead of it. */
export function queuedAt(url) {
  const ahead = unbegun.get(url) || 0;
  unbegun.set(url, ahead + 1);
  return ahead;
}

/** A request sent to `url` has its first token (or its attempt ended). */
export function begunAt(url) {
  const n = (unbegun.get(url) || 1) - 1;
  if (n <= 0) unbegun.delete(url);
  else unbegun.set(url, n);
}

/** Requests the pod itself says are waiting for the engine (vLLM's num_requests_waiting), or null when unknown or stale. */
export function podWaiting(url, now) {
  const m = metrics.get(url);
  return m === undefined || m.missing || now - m.at > METRICS_FRESH_MS ? null : m.waiting;
}
