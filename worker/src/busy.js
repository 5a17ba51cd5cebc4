// @ts-check
// Busy is not broken (docs/worker.md, "Whose failure"): what a first-token deadline miss
// says about its pod. A pod makes new requests wait while its queue is long (a vLLM engine
// prefills prompts in turn, so a request's first token waits for every prompt ahead of it);
// a miss then says the pod was busy, not that it is broken, and one key's queue must never
// open a breaker for every key. So a miss is judged in the background, never on the
// request's path, from what the router can check:
//   - the pod's health check (`GET /health`, at most once a second per pod per isolate):
//     a pod that does not answer it is broken, whatever its queue (a failure of no key);
//   - its queue: this isolate's requests sent there before this one still waiting for their
//     first token, or the pod's own word (vLLM's `num_requests_waiting` on /metrics);
//     either says busy, and nothing is reported;
//   - neither: the pod was idle and still missed, which is the pod's failure, reported with
//     the request's key once its fate says so (two keys, or a failed health check, open).

import { healthOk } from "./forward.js";
import { healthDue, healthSeen, lastHealth, metricsDue, podWaiting, putMetrics, waitingAt } from "./pods.js";
import { report } from "./state.js";

/**
 * `podUrl` missed a request's first-token deadline with `ahead` of this isolate's requests
 * waiting there before it; `verdict` is the request's fate (pods.js blameOf: "pod" when the
 * fallback answered it). Judged and reported in `ctx.waitUntil` (`witness`: the health check
 * the object may ask for, as for any failure); returns that task.
 */
export function judgeMiss(env, ctx, cfg, podUrl, from, ahead, verdict, fetchImpl, witness = null) {
  const task = missVerdict(cfg, podUrl, ahead, fetchImpl).then((v) => {
    if (v === "broken") return report(env, ctx, cfg, podUrl, false, { key: null, health: true });
    if (v === "idle" && verdict === "pod") return report(env, ctx, cfg, podUrl, false, from, witness);
    return null;
  });
  ctx.waitUntil(task);
  return task;
}

/**
 * Whether `podUrl` has a queue a new request would wait behind, as far as this isolate
 * knows: its own requests there still waiting for their first token, or the pod's word
 * (fresh /metrics). Synchronous: the hot path asks it.
 */
export function podBusy(podUrl, now) {
  return waitingAt(podUrl) > 0 || (podWaiting(podUrl, now) ?? 0) > 0;
}

/** "broken" (no health), "busy" (a queue ahead of the request) or "idle". */
export async function missVerdict(cfg, podUrl, ahead, fetchImpl) {
  let healthy = lastHealth(podUrl);
  if (healthDue(podUrl, Date.now())) {
    healthy = await healthOk(fetchImpl, podUrl, cfg.deadlineMs, cfg.podToken);
    healthSeen(podUrl, healthy);
  }
  if (healthy === false) return "broken";
  if (ahead > 0) return "busy";
  let waiting = podWaiting(podUrl, Date.now());
  if (waiting === null && metricsDue(podUrl, Date.now())) {
    await scrapeMetrics(fetchImpl, podUrl, cfg);
    waiting = podWaiting(podUrl, Date.now());
  }
  return waiting !== null && waiting > 0 ? "busy" : "idle";
}

/** GET <pod>/metrics: vLLM's load gauges, for balancing and for judging a miss (pods.js putMetrics). */
export async function scrapeMetrics(fetchImpl, podUrl, cfg) {
  const ac = new AbortController();
  const timer = setTimeout(() => ac.abort(), cfg.deadlineMs);
  let text = null;
  try {
    const res = await fetchImpl(podUrl + "/metrics", { headers: { authorization: `Bearer ${cfg.podToken}` }, signal: ac.signal,
      redirect: "manual" });
    if (res.ok) text = await res.text();
    else await res.body?.cancel().catch(() => {});
  } catch {
    // unreachable: no metrics; the breaker hears of it from requests
  } finally {
    clearTimeout(timer);
  }
  putMetrics(podUrl, text, Date.now());
}
