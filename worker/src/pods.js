// @ts-check
// Which pod serves a request: the breaker's verdict per pod, then the fewest requests in
// flight in this isolate (ties broken at random). Pure but for the in-flight counters,
// which are plain numbers in module scope.

import { CLOSED, route } from "./machine.js";

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

/** The index with the fewest requests in flight here; ties broken at random. */
export function leastBusy(urls, indexes) {
  let best = -1;
  let bestLoad = Infinity;
  let ties = 0;
  for (const i of indexes) {
    const load = inflight.get(urls[i]) || 0;
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

/** Whether a health check of `url` may run now (and, if so, that it is running). */
export function healthDue(url, now) {
  const last = healthAt.get(url);
  if (last !== undefined && now - last < HEALTH_EVERY_MS) return false;
  healthAt.set(url, now);
  return true;
}
