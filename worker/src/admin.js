// The operator endpoints, all behind PROBE_TOKEN: probe, breaker override, purge.

import { readBody, parseJsonObject } from "./body.js";
import { HttpError, jsonResponse } from "./errors.js";
import { FORCE_VALUES } from "./machine.js";
import { cache, activeStub, infoOf, stubFor } from "./state.js";
import { fetchColo, rayColo } from "./trace.js";
import { now, serverTiming, PROBE_METRICS } from "./timing.js";

const ADMIN_BODY_LIMIT = 4096;

async function digest(text) {
  return new Uint8Array(await crypto.subtle.digest("SHA-256", new TextEncoder().encode(text)));
}

/** Constant-time comparison: both sides are hashed to equal length, then every byte is compared. */
export async function tokenMatches(given, expected) {
  const [a, b] = await Promise.all([digest(given), digest(expected)]);
  let diff = 0;
  for (let i = 0; i < a.length; i++) diff |= a[i] ^ b[i];
  return diff === 0 && typeof given === "string";
}

async function authorise(request, cfg) {
  const header = request.headers.get("authorization") || "";
  const m = /^Bearer\s+(.+)$/i.exec(header);
  if (!m) throw new HttpError(401, "unauthorized", "send Authorization: Bearer <probe token>");
  if (!(await tokenMatches(m[1].trim(), cfg.probeToken))) throw new HttpError(401, "unauthorized", "the probe token is wrong");
}

async function jsonBody(request) {
  return parseJsonObject(await readBody(request, ADMIN_BODY_LIMIT));
}

export async function handleAdmin(request, env, ctx, cfg, url, r, fetchImpl) {
  await authorise(request, cfg);
  if (r.kind === "probe") return probe(request, env, cfg, fetchImpl);
  if (r.kind === "breaker") return breaker(request, env, cfg);
  return purge(request, env, cfg);
}

async function podHealth(cfg, fetchImpl) {
  const t = now();
  try {
    const res = await fetchImpl(cfg.podUrls[0] + "/health", { signal: AbortSignal.timeout(cfg.deadlineMs) });
    await res.body?.cancel().catch(() => {});
    return { ms: now() - t, ok: res.status === 200, status: res.status };
  } catch {
    return { ms: now() - t, ok: false, status: null };
  }
}

async function probe(request, env, cfg, fetchImpl) {
  const t0 = now();
  // The first touch of a new generation: stubFor passes ACTIVE_HINT as locationHint.
  const stub = activeStub(env, cfg);
  const t = now();
  const snap = await stub.snapshot(infoOf(cfg));
  const stateRtt = now() - t;
  cache.put(cfg.activeGeneration, snap, Date.now());
  const [workerColo, stateColo, pod] = await Promise.all([
    fetchColo(fetchImpl),
    stub.colo().catch(() => null),
    podHealth(cfg, fetchImpl),
  ]);
  const body = {
    worker_colo: workerColo,
    cf_placement: request.headers.get("cf-placement"),
    ray_colo: rayColo(request.headers.get("cf-ray")),
    state_colo: stateColo,
    state_rtt_ms: round(stateRtt),
    pod_rtt_ms: round(pod.ms),
    pod_ok: pod.ok,
    pod_status: pod.status,
    generation: cfg.activeGeneration,
    hint: cfg.activeHint,
    draining_generation: cfg.drainingGeneration,
    region: cfg.region,
    pod_host: new URL(cfg.podUrls[0]).host,
    breaker: snap,
  };
  const timing = serverTiming({ state_rtt: stateRtt, pod_rtt: pod.ms, total: now() - t0 }, PROBE_METRICS);
  return jsonResponse(200, body, { "server-timing": timing, "cache-control": "no-store" });
}

async function breaker(request, env, cfg) {
  const stub = activeStub(env, cfg);
  let snap;
  if (request.method === "PUT") {
    const body = await jsonBody(request);
    if (!Object.prototype.hasOwnProperty.call(body, "force") || !FORCE_VALUES.includes(body.force)) {
      throw new HttpError(400, "invalid_field", `field "force" must be "open", "closed" or null (got ${JSON.stringify(body.force ?? "missing")})`);
    }
    snap = await stub.setForce(body.force, infoOf(cfg));
  } else {
    snap = await stub.snapshot(infoOf(cfg));
  }
  cache.put(cfg.activeGeneration, snap, Date.now());
  return jsonResponse(200, { generation: cfg.activeGeneration, breaker: snap }, { "cache-control": "no-store" });
}

async function purge(request, env, cfg) {
  const body = await jsonBody(request);
  const gen = body.generation;
  if (typeof gen !== "string" || gen === "") {
    throw new HttpError(400, "invalid_field", "field \"generation\" must be a generation name");
  }
  if (gen === cfg.activeGeneration) {
    throw new HttpError(409, "active_generation", `refusing to purge ${gen}: it is the active generation`);
  }
  const result = await stubFor(env, gen, gen === cfg.drainingGeneration ? cfg.drainingHint : "").purge();
  cache.drop(gen);
  return jsonResponse(200, { generation: gen, purged: true, ...result });
}

function round(ms) {
  return Math.round(ms * 100) / 100;
}
