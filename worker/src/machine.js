// The circuit breaker's state machine, pure: no I/O, the clock passed in.
//
//            FAILURE_THRESHOLD consecutive failures (errors or deadline misses)
//   closed ───────────────────────────────────────────────────────────────▶ open
//     ▲                                                                      │
//     │ trial succeeds                              OPEN_MS elapsed, the next │
//     │                                             request is granted the    │
//   half-open ◀──────────────────────────────────── one trial (grantTrial)    │
//     │ trial fails (or its lease runs out: another request may try)          │
//     └──────────────────────────────────────────────────────────────────────▶ open
//
// `forced` ("open" | "closed" | null) is the operator override: it wins over the
// machine, which keeps counting underneath so that clearing it resumes where it was.
// Each pod has its own machine; the generation object (generation.js) owns the rows and
// applies these functions; the router (pods.js) only calls `route` on its cached copy.

export const CLOSED = "closed";
export const OPEN = "open";
export const HALF_OPEN = "half-open";
export const FORCE_VALUES = ["open", "closed", null];

export function initial() {
  return { state: CLOSED, failures: 0, opened_at: null, trial_at: null, forced: null, updated_at: null };
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

/** Apply one outcome of a request to the pod. */
export function record(snap, ok, now, cfg) {
  if (ok) {
    if (snap.state === CLOSED && snap.failures === 0) return snap;
    return { ...snap, state: CLOSED, failures: 0, opened_at: null, trial_at: null, updated_at: now };
  }
  const failures = snap.failures + 1;
  if (snap.state === HALF_OPEN || (snap.state === OPEN) || failures >= cfg.failureThreshold) {
    // A failed trial (or a late failure while open) restarts the open period.
    return { ...snap, state: OPEN, failures, opened_at: now, trial_at: null, updated_at: now };
  }
  return { ...snap, failures, updated_at: now };
}
