// @ts-check
// The circuit breaker's state machine, pure: no I/O, the clock passed in.
//
//            FAILURE_THRESHOLD consecutive failures (errors or deadline misses),
//            from two keys or with a failed health check
//   closed ───────────────────────────────────────────────────────────────▶ open
//     ▲                                                                      │
//     │ trial succeeds                              OPEN_MS elapsed, the next │
//     │                                             request is granted the    │
//   half-open ◀──────────────────────────────────── one trial (grantTrial)    │
//     │ trial fails (or its lease runs out: another request may try)          │
//     └──────────────────────────────────────────────────────────────────────▶ open
//
// Whose failure (docs/worker.md, "Whose failure"): a failure carries where it came from,
// the key of the request or a health check (no key). The streak opens the breaker only
// once its failures come from at least two distinct keys, or a health check failed too:
// one key's requests alone never open it, whatever they do. `failure_keys` lists the
// streak's sources (HEALTH for a health check, UNKNOWN for a report without a key, as an
// isolate of an older version sends); `witness` says the streak has reached the threshold
// from one key and waits for a health check.
//
// `forced` ("open" | "closed" | null) is the operator override: it wins over the
// machine, which keeps counting underneath so that clearing it resumes where it was.
// Each pod has its own machine; the generation object (generation.js) owns the rows and
// applies these functions; the router (pods.js) only calls `route` on its cached copy.

export const CLOSED = "closed";
export const OPEN = "open";
export const HALF_OPEN = "half-open";
export const FORCE_VALUES = ["open", "closed", null];

export const HEALTH = "~health";
export const UNKNOWN = "~unknown";
const MAX_SOURCES = 8; // two distinct ones decide; a few more make the row say who failed

export function initial() {
  return { state: CLOSED, failures: 0, opened_at: null, trial_at: null, forced: null, updated_at: null, failure_keys: [] };
}

/** The source of an outcome: a key id, HEALTH, or UNKNOWN. */
export function sourceOf(from) {
  if (from && from.health) return HEALTH;
  return (from && typeof from.key === "string" && from.key) || UNKNOWN;
}

/** Whether a streak's sources put the blame on the pod: two distinct ones, or a health check. */
export function blamed(sources) {
  return sources.length >= 2 || sources.includes(HEALTH);
}

/** A closed pod whose streak has reached the threshold from one key: a health check decides. */
export function needsWitness(snap, cfg) {
  return snap.state === CLOSED && snap.failures >= cfg.failureThreshold && !blamed(snap.failure_keys || []);
}

/** How long a granted trial may run before another request may take over. */
export function trialLeaseMs(cfg) {
  return cfg.deadlineMs + 1000;
}

/**
 * Where a request goes given a snapshot: "pod", "fallback", or "trial" (ask the object
 * for the one trial slot; only then may it go to the pod).
 */
export function route(snap, now, cfg) {
  if (snap.forced === OPEN) return "fallback";
  if (snap.forced === CLOSED) return "pod";
  if (snap.state === CLOSED) return "pod";
  if (snap.state === OPEN) return now - snap.opened_at >= cfg.openMs ? "trial" : "fallback";
  // half-open: someone holds the trial; when its lease has run out another may try.
  return now - snap.trial_at >= trialLeaseMs(cfg) ? "trial" : "fallback";
}

/** The object's answer to a trial request: at most one holder per lease. */
export function grantTrial(snap, now, cfg) {
  if (route({ ...snap, forced: null }, now, cfg) !== "trial") return { granted: false, snap };
  return { granted: true, snap: { ...snap, state: HALF_OPEN, trial_at: now, updated_at: now } };
}

/**
 * Apply one outcome to the pod: of a request (`from.key`), or a failed health check
 * (`from.health`). A success closes and forgets the streak.
 */
export function record(snap, ok, now, cfg, from = null) {
  if (ok) {
    if (snap.state === CLOSED && snap.failures === 0) return snap;
    return { ...snap, state: CLOSED, failures: 0, opened_at: null, trial_at: null, updated_at: now, failure_keys: [] };
  }
  const failures = snap.failures + 1;
  const before = snap.failure_keys || [];
  const source = sourceOf(from);
  const sources = before.includes(source) || before.length >= MAX_SOURCES ? before : [...before, source];
  if (snap.state === HALF_OPEN || (snap.state === OPEN)) {
    // A failed trial (or a late failure while open) restarts the open period.
    return { ...snap, state: OPEN, failures, opened_at: now, trial_at: null, updated_at: now, failure_keys: sources };
  }
  if (failures >= cfg.failureThreshold && blamed(sources)) {
    return { ...snap, state: OPEN, failures, opened_at: now, trial_at: null, updated_at: now, failure_keys: sources };
  }
  return { ...snap, failures, updated_at: now, failure_keys: sources };
}

// --- pace: a pod that starts answers but makes tokens too slowly (docs/worker.md, "Pace") ---
//
// Not a breaker state: a slow pod still serves, and its requests are not bought from the
// fallback; it is only passed over by balancing while another pod is not slow. A pace
// report is a verdict on one answer of at least PACE_MIN_TOKENS tokens a choice (router.js):
// "slow" below colocate:worker.minTokensPerS, "ok" at or above. FAILURE_THRESHOLD slow
// verdicts in a row from at least two keys mark the pod slow for OPEN_MS; an "ok" verdict
// forgets the streak. So one key's tiny requests cannot mark a pod (they are too short to
// be judged) and a long answer never does (its length is not its pace).

/** @returns {{n: number, keys: string[], until: number}} */
export function initialPace() {
  return { n: 0, keys: [], until: 0 };
}

/** One pace verdict (`slow` or not) from `from` (a key id, or none) at `now`. */
export function recordPace(p, slow, now, cfg, from = null) {
  if (!slow) return p.n === 0 ? p : { ...p, n: 0, keys: [] };
  const source = sourceOf(from);
  const keys = p.keys.includes(source) || p.keys.length >= MAX_SOURCES ? p.keys : [...p.keys, source];
  const n = p.n + 1;
  if (n >= cfg.failureThreshold && keys.length >= 2) return { n: 0, keys: [], until: now + cfg.openMs };
  return { ...p, n, keys };
}
