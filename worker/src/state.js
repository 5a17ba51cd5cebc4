// The Worker's side of the breaker: which object, its cached snapshot, and reports.
//
// Every call passes `info` (the generation names and the machine's numbers) so the
// object needs no bindings of its own beyond BREAKER, which it uses for read-through.

import { log } from "./errors.js";
import { initial, worthReporting } from "./machine.js";
import { SnapshotCache } from "./cache.js";
import { now } from "./timing.js";

export const cache = new SnapshotCache(); // module scope: lives as long as the isolate
const ids = new Map(); // generation -> DurableObjectId (plain data, safe to keep)

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
  };
}

export function activeStub(env, cfg) {
  return stubFor(env, cfg.activeGeneration, cfg.activeHint);
}

/**
 * The snapshot a request routes on, and how long it waited for it (ms). Fresh cache:
 * no wait, no I/O. Half-way to stale: no wait, refresh in the background.
 */
export async function currentState(env, ctx, cfg) {
  const gen = cfg.activeGeneration;
  const status = cache.status(gen, Date.now(), cfg.stateTtlMs);
  if (status === "fresh") return { snap: cache.get(gen), wait: 0 };
  if (status === "refresh") {
    cache.markRefreshing(gen, Date.now());
    ctx.waitUntil(fetchSnapshot(env, cfg).catch(() => {}));
    return { snap: cache.get(gen), wait: 0 };
  }
  const t = now();
  try {
    const snap = await fetchSnapshot(env, cfg);
    return { snap, wait: now() - t };
  } catch (err) {
    // The object is unreachable: route on what we last knew (or closed) rather than fail.
    log(env, "state_unavailable", { generation: gen, error: String(err && err.message) });
    return { snap: cache.get(gen) || initial(), wait: now() - t };
  }
}

export async function fetchSnapshot(env, cfg) {
  const snap = await activeStub(env, cfg).snapshot(infoOf(cfg));
  cache.put(cfg.activeGeneration, snap, Date.now());
  return snap;
}

/** Ask the object for the half-open trial slot (a wait, counted in `state`). */
export async function requestTrial(env, cfg) {
  const res = await activeStub(env, cfg).tryTrial(infoOf(cfg));
  cache.put(cfg.activeGeneration, res.snap, Date.now());
  return res.granted;
}

/** Tell the object how the pod did, without delaying the response. */
export function report(env, ctx, cfg, snap, ok, trial) {
  if (!trial && !worthReporting(snap, ok)) return;
  const gen = cfg.activeGeneration;
  ctx.waitUntil(
    Promise.resolve()
      .then(() => activeStub(env, cfg).report(ok, infoOf(cfg)))
      .then((next) => {
        if (next.state !== snap.state) log(env, "breaker", { generation: gen, from: snap.state, to: next.state });
        cache.put(gen, next, Date.now());
      })
      .catch((err) => log(env, "report_failed", { generation: gen, error: String(err && err.message) })),
  );
}
